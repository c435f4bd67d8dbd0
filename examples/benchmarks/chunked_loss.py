"""Per-rank memory and time of a training step with the LM head's logits kept, and with the chunked loss.

    python examples/benchmarks/chunked_loss.py                        # bench-llama-151k, TP=2, 1 x 2048 and 4096
    python examples/benchmarks/chunked_loss.py --seqs 8192 --tp 1 --json loss.json

Each setting runs ``mtk bench``'s mtk contender (a real TP run with an AdamW step) in fresh processes (forked from
one that imported torch with ``--fork_workers``, CPU only):
``logits kept`` is the loss as HF's forward computes it (``loss_chunk_tokens = 0``: ``[b, s, V/tp]`` logits, then
the vocab-parallel cross-entropy, which keeps its softmax for backward); ``chunked`` is mtk's default (chunks of at
most 256 MiB of fp32 logits), ``chunked N`` chunks of N tokens. Reported for rank 0: live bytes at the step's peak
from torch's MemTracker (activations, temporaries, total), the peak RSS above what the process held before the
model was built (CUDA: max allocated) and the median step time, each next to ``logits kept`` of the same length in
the same run. docs/memory.md keeps the latest table.
"""

from __future__ import annotations

import argparse
import json

from mtk.bench.measure import BenchSpec
from mtk.bench.runner import run_bench
from mtk.training.entry import run_main


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-llama-151k")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per chunk of the 'chunked N' row")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", help="also write the table to this JSON file")
    parser.add_argument(
        "--fork_workers",
        action="store_true",
        help="CPU only: fork each run's workers from a process that imported torch once, as mtk bench's flag does "
        "(seconds faster per run; the RSS column then counts pages shared with it, the live bytes do not)",
    )
    args = parser.parse_args(argv)
    settings = {"logits kept": 0, "chunked": None, f"chunked {args.chunk}": args.chunk}
    rows: dict[str, dict[str, dict[str, float]]] = {}
    for seq in args.seqs:
        for name, chunk in settings.items():
            spec = BenchSpec(
                args.model, args.tp, 1, args.batch, seq, steps=args.steps, loss_chunk_tokens=chunk, track_memory=True
            )
            (summary,), _ = run_bench(
                spec, ["mtk"], 1, progress=lambda line: None, timeout=3600, fork_workers=args.fork_workers
            )
            if summary.error:
                raise SystemExit(f"{name} at {seq}: {summary.error}")
            kinds = summary.memory_by_kind[0]
            rows.setdefault(str(seq), {})[name] = {
                "activations_mib": kinds["act"] / 2**20,
                "temporaries_mib": kinds["temp"] / 2**20,
                "total_mib": kinds["total"] / 2**20,
                "rss_above_start_mib": summary.memory_above_start[0] / 2**20,
                "step_s": summary.median_s,
            }
    print(f"{args.model} tp={args.tp} batch {args.batch}, fp32, rank 0, MiB (x logits kept)")
    header = ("seq", "loss", "activations", "temporaries", "total at peak", "RSS above start", "s/step")
    print("{:>6} {:<14} {:>16} {:>12} {:>18} {:>18} {:>14}".format(*header))
    for seq, by_setting in rows.items():
        base = by_setting["logits kept"]
        for name, row in by_setting.items():
            act, total, rss, step = row["activations_mib"], row["total_mib"], row["rss_above_start_mib"], row["step_s"]
            print(
                f"{seq:>6} {name:<14} {act:>8.0f} ({act / base['activations_mib']:.2f}x) "
                f"{row['temporaries_mib']:>12.0f} {total:>9.0f} ({total / base['total_mib']:.2f}x) "
                f"{rss:>9.0f} ({rss / base['rss_above_start_mib']:.2f}x) {step:>6.2f} ({step / base['step_s']:.2f}x)"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    run_main(main, "chunked_loss.py")
