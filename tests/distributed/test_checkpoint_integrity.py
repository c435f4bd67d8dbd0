"""A damaged shard that only one TP rank reads is found by every rank: all refuse with the same line
naming the file, none is left waiting in a collective."""

import torch

from mtk.checkpoint import CheckpointError
from mtk.checkpoint.sharded import load_checkpoint, save_checkpoint
from mtk.convert import parallelize
from mtk.models import build_model
from mtk.parallel import ParallelState
from mtk.testing import run_distributed


def _saved(world_size: int, directory: str, *, stepped: bool = False):
    """A TP ``world_size`` tiny-llama and its AdamW saved at ``directory`` (after one step with ``stepped``)."""
    parallel = ParallelState.build(tp_size=world_size)
    model = parallelize(build_model("tiny-llama"), parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if stepped:
        ids = torch.tensor([[1, 2, 3, 4]])
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    return parallel, model, optimizer, save_checkpoint(directory, parallel, model, [optimizer], [], step=1)


def _load_or_refusal(directory: str, parallel, model, optimizer) -> str:
    """What loading ``directory`` says on this rank, after every rank has crafted its part."""
    torch.distributed.barrier()
    try:
        load_checkpoint(directory, parallel, model, [optimizer], [])
    except CheckpointError as err:
        return str(err)
    return "loaded"


def _rehash(path, name: str) -> None:
    """Record ``path / name``'s new size and checksum in the checkpoint's metadata (what a crafted file carries)."""
    import json

    from mtk.checkpoint.integrity import file_checksum

    meta = json.loads((path / "metadata.json").read_text())
    meta["files"][name] = {"bytes": (path / name).stat().st_size, "xxh3_128": file_checksum(path / name)}
    (path / "metadata.json").write_text(json.dumps(meta))


def _save_damage_load(rank: int, world_size: int, directory: str) -> str:
    parallel, model, optimizer, path = _saved(world_size, directory)
    if rank == 0:
        shard = path / "model" / "tp01-pp00.safetensors"  # read by TP rank 1 only
        data = bytearray(shard.read_bytes())
        data[-3] ^= 0x01
        shard.write_bytes(bytes(data))
    return _load_or_refusal(directory, parallel, model, optimizer)


def test_every_rank_refuses_a_shard_only_one_rank_reads(tmp_path):
    errors = run_distributed(_save_damage_load, world_size=2, args=(str(tmp_path / "step_1"),))
    assert errors[0] == errors[1], errors
    assert "model/tp01-pp00.safetensors does not match its recorded xxh3_128" in errors[0]


def _replicas_differ(rank: int, world_size: int, directory: str, state: bool) -> str:
    from safetensors.torch import load_file, save_file

    parallel, model, optimizer, path = _saved(world_size, directory, stepped=True)
    if rank == 0:  # TP rank 1's copy of the final norm (or its Adam moment) changed, its checksum rewritten with it
        name = ("optimizer" if state else "model") + "/tp01-pp00.safetensors"
        tensors = load_file(str(path / name))
        key = "model.norm.weight" + ("::exp_avg" if state else "")
        tensors[key] = tensors[key] * 3
        save_file(tensors, str(path / name), metadata=_metadata(path / name))
        _rehash(path, name)
    return _load_or_refusal(directory, parallel, model, optimizer)


def _metadata(path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        return handle.metadata() or {}


def test_replicas_that_differ_between_the_tp_ranks_files_are_refused(tmp_path):
    """Every TP rank reads its own file; a norm (or its optimizer state) that is not the same in each, its checksum
    rewritten to match, trained TP ranks with different replicas (still 2.0 apart after a step) with exit 0. Every
    rank refuses it, naming the tensor."""
    for state in (False, True):
        errors = run_distributed(_replicas_differ, world_size=2, args=(str(tmp_path / f"step_{int(state)}"), state))
        assert errors[0] == errors[1], errors
        name = "model.norm.weight::exp_avg" if state else "model.norm.weight"
        assert f"{name} differs between the TP ranks' files" in errors[0], errors[0]


def _rng_of_one_rank_crafted(rank: int, world_size: int, directory: str) -> str:
    parallel, model, optimizer, path = _saved(world_size, directory)
    if rank == 0:  # rank 1's RNG state replaced by a dict of another shape, its checksum rewritten with it
        torch.save({"python": 1}, path / "rng" / "rank00001.pt")
        _rehash(path, "rng/rank00001.pt")
    return _load_or_refusal(directory, parallel, model, optimizer)


def test_a_file_only_one_rank_reads_and_refuses_stops_every_rank(tmp_path):
    """Rank 1 refused its crafted RNG state in one line while rank 0 went on into training and failed in a
    collective ("a collective failed"). Now every rank stops at the load: rank 1 with its line, rank 0 naming it."""
    errors = run_distributed(_rng_of_one_rank_crafted, world_size=2, args=(str(tmp_path / "step_1"),))
    assert "rng/rank00001.pt does not hold what this run loads from it" in errors[1], errors
    assert errors[0] == "rank 1 refused the checkpoint (its line says why)", errors
