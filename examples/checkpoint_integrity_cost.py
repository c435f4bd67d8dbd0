"""What checkpoint integrity costs: the time to hash and fsync a checkpoint vs the time to save and load it.

    python examples/checkpoint_integrity_cost.py            # a ~100 MB checkpoint (weights + AdamW state)

One process: a Llama of ~8.7M parameters is saved with mtk's ``save_checkpoint`` (which hashes and
fsyncs every file, see mtk/checkpoint/integrity.py) and loaded back (which checks every checksum).
The hashing and the fsync are timed on their own on the same files, so the printed shares are of one
run. With TP/DP the hashing is split over all ranks; this single process does all of it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mtk.checkpoint.integrity import file_checksum, list_files, verify_files
from mtk.checkpoint.meta import read_metadata
from mtk.checkpoint.sharded import load_checkpoint, save_checkpoint
from mtk.convert import parallelize
from mtk.parallel import ParallelState


def _timed(fn, *args, **kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def _checksums(files: list[Path], sync: bool) -> None:
    for path in files:
        file_checksum(path, sync=sync)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=320, help="hidden size (default 320: a ~100 MB checkpoint)")
    parser.add_argument("--repeats", type=int, default=5)
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
    save, load, hashing, fsync, verify = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            directory = Path(tmp) / f"step_{i}"
            save.append(_timed(save_checkpoint, directory, parallel, model, [optimizer], [], step=i))
            load.append(_timed(load_checkpoint, directory, parallel, model, [optimizer], []))
            files = [directory / name for name in list_files(directory)]
            hashing.append(_timed(_checksums, files, sync=False))
            fsync.append(_timed(_checksums, files, sync=True) - hashing[-1])
            verify.append(_timed(verify_files, directory, read_metadata(directory).files))
        size = sum(f.stat().st_size for f in files) / 2**20
    med = statistics.median
    print(f"checkpoint {size:.0f} MiB, {len(files)} files; median of {args.repeats} (seconds)")
    print(
        f"  save (hash + fsync included) {med(save):.3f}   hashing {med(hashing):.3f} "
        f"({med(hashing) / med(save):.0%} of save)   fsync ~{max(med(fsync), 0):.3f}"
    )
    print(f"  load (verify included)       {med(load):.3f}   verify  {med(verify):.3f} "
          f"({med(verify) / med(load):.0%} of load)")  # fmt: skip


if __name__ == "__main__":
    main()
