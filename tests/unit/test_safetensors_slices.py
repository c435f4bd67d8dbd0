"""mtk's positioned-read slicer returns exactly what safetensors' own reader returns."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mtk.checkpoint.safetensors_slices import SafetensorsError, SafetensorsFile

TENSORS = {
    "matrix": torch.randn(6, 10),
    "cube": torch.randn(3, 8, 5),
    "half": torch.randn(4, 6).to(torch.bfloat16),
    "vector": torch.randn(7),
    "scalar": torch.tensor(3.5),
    "ints": torch.arange(12, dtype=torch.int64).view(3, 4),
}


@pytest.fixture
def path(tmp_path):
    file = tmp_path / "t.safetensors"
    save_file(TENSORS, str(file), metadata={"format": "pt"})
    return file


def _index(ndim, dim, start, stop):
    return tuple(slice(start, stop) if d == dim else slice(None) for d in range(ndim))


def test_slices_match_safetensors(path):
    with SafetensorsFile(path) as mine, safe_open(str(path), "pt") as theirs:
        assert sorted(mine.keys()) == sorted(theirs.keys())
        for name, tensor in TENSORS.items():
            assert torch.equal(mine.get_slice(name)[tuple(slice(None) for _ in tensor.shape)], tensor), name
            for dim in range(tensor.dim()):
                for start, stop in [(0, 1), (1, tensor.shape[dim]), (0, 0)]:
                    index = _index(tensor.dim(), dim, start, stop)
                    got = mine.get_slice(name)[index]
                    assert torch.equal(got, theirs.get_slice(name)[index]), (name, dim, start, stop)
                    assert got.is_contiguous()


def test_reads_only_the_slice(path):
    with SafetensorsFile(path) as f:
        slicer = f.get_slice("cube")
        slicer[_index(3, 1, 2, 6)]  # 3 runs of 4*5 floats
        assert slicer.bytes_read == 3 * 4 * 5 * 4


def test_several_dimensions_sliced_read_only_their_runs(path):
    """An expert-parallel rank's experts of a fused [E, 2I, H] tensor and its TP slice of each (it was an
    IndexError: a directory mtk export wrote could not be loaded under EP)."""
    with SafetensorsFile(path) as mine, safe_open(str(path), "pt") as theirs:
        for index in [(slice(1, 3), slice(2, 6), slice(None)), (slice(None), slice(1, 4), slice(0, 2)),
                      (slice(0, 3), slice(0, 8), slice(1, 5)), (slice(2, 2), slice(1, 3), slice(None))]:  # fmt: skip
            slicer = mine.get_slice("cube")
            got = slicer[index]
            assert torch.equal(got, theirs.get_slice("cube")[index]) and got.is_contiguous(), index
            assert slicer.bytes_read == got.numel() * 4, index  # the selected elements only


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda b: b[:5], "shorter than its 8-byte header length"),
        (lambda b: b[:100], "header length"),
        (lambda b: b[:8] + b"{" * (len(b) - 8), "not JSON"),
        (lambda b: b[:-16], "truncated or corrupt"),
    ],
)
def test_corrupt_files_are_refused(path, damage, message):
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(SafetensorsError, match=message):
        SafetensorsFile(path)
