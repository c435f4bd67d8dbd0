"""What checkpoint integrity costs: a save and a load with it against the same save and load without it.

    python examples/benchmarks/checkpoint_integrity_cost.py            # a ~100 MB checkpoint (weights + AdamW state)

One process: a Llama of ~8.7M parameters is saved with mtk's ``save_checkpoint`` (which hashes and
fsyncs every file, see mtk/checkpoint/integrity.py) and loaded back (which checks every checksum), then
the same with the hashing, fsync and check switched off; the rounds alternate and the medians are
compared, so the printed overhead is of one run on one machine. With TP/DP the hashing is split over
all ranks; this single process does all of it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mtk.checkpoint import integrity, sharded
from mtk.checkpoint.integrity import list_files
from mtk.checkpoint.meta import read_metadata
from mtk.checkpoint.sharded import load_checkpoint, save_checkpoint
from mtk.convert import parallelize
from mtk.parallel import ParallelState


def _timed(fn, *args, **kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def _fsync_only(path: Path, *, sync: bool = False) -> str:
    if sync:
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    return ""


@contextmanager
def _variant(name: str):
    """``checksums``: mtk's save and load. ``fsync only``: the same save (files fsynced on the same threads,
    directories too) with no hashing, and a load without checks. ``neither``: no fsync either, torch's
    habit, a save that a crash can leave empty. Same files, same code otherwise."""
    if name == "checksums":
        yield
        return
    with (
        mock.patch.object(integrity, "file_checksum", _fsync_only),
        mock.patch.object(sharded, "read_verified", read_metadata),
    ):
        if name == "neither":
            with mock.patch.object(integrity, "file_checksum", lambda path, sync=False: ""):
                yield
        else:
            yield


VARIANTS = ("checksums", "fsync only", "neither")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=320, help="hidden size (default 320: a ~100 MB checkpoint)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    config = LlamaConfig(
        vocab_size=8192, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8,
    )  # fmt: skip
    parallel = ParallelState.build()
    model = parallelize(LlamaForCausalLM(config), parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 8192, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for variant in VARIANTS:
                directory = Path(tmp) / f"step_{i}_{variant.replace(' ', '_')}"
                with _variant(variant):
                    save = _timed(save_checkpoint, directory, parallel, model, [optimizer], [], step=i)
                    load = _timed(load_checkpoint, directory, parallel, model, [optimizer], [])
                times.setdefault(("save", variant), []).append(save)
                times.setdefault(("load", variant), []).append(load)
        first = Path(tmp) / "step_0_checksums"
        files = list_files(first)
        size = sum((first / name).stat().st_size for name in files) / 2**20
    med = {key: statistics.median(values) for key, values in times.items()}
    print(f"checkpoint {size:.0f} MiB, {len(files)} files; median of {args.repeats} interleaved rounds (seconds)")
    for what in ("save", "load"):
        # paired by round: the storage's drift between rounds (writeback, a busy host) cancels out
        extra = statistics.median(a - b for a, b in zip(times[what, "checksums"], times[what, "fsync only"]))
        cells = "   ".join(f"{variant} {med[what, variant]:.3f}" for variant in VARIANTS)
        print(f"  {what}: {cells}   checksums add {extra:+.4f} ({extra / med[what, 'fsync only']:+.1%})")


if __name__ == "__main__":
    main()
