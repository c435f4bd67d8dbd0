"""Per-rank memory of one training step with sequence parallelism and activation recomputation on and off.

    python examples/memory_features.py                       # bench-llama, TP=2, batch 2 x seq 1024
    python examples/memory_features.py --seq 2048 --json mem.json

Each setting runs ``mtk bench``'s mtk contender (a real TP run with an AdamW step) in fresh processes and
reports, for rank 0: the live bytes at the step's peak by kind, from torch's MemTracker (activations,
temporaries, total; weights, gradients and optimizer state are the same in all settings) and the peak
above what the process held before the model was built (CPU: peak RSS, which glibc's allocator caching
blurs; CUDA: max allocated), each next to the baseline (neither feature) of the same run.
docs/memory.md keeps the latest table.
"""

from __future__ import annotations

import argparse
import json

from mtk.bench.contenders import BenchSpec
from mtk.bench.runner import run_bench
from mtk.errors import run_main

SETTINGS = {  # name -> (sequence_parallel, recompute)
    "baseline": (False, None),
    "sequence parallel": (True, None),
    "selective recompute": (False, "selective"),
    "full recompute": (False, "full"),
    "SP + full recompute": (True, "full"),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-llama")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--json", help="also write the table to this JSON file")
    args = parser.parse_args(argv)
    rows = {}
    for name, (sequence_parallel, recompute) in SETTINGS.items():
        spec = BenchSpec(
            args.model,
            args.tp,
            1,
            args.batch,
            args.seq,
            steps=1,
            sequence_parallel=sequence_parallel,
            recompute=recompute,
            track_memory=True,
        )
        (summary,), _ = run_bench(spec, ["mtk"], 1, progress=lambda line: None, timeout=1800)
        if summary.error:
            raise SystemExit(f"{name}: {summary.error}")
        kinds = summary.memory_by_kind[0]
        rows[name] = {
            "activations_mib": kinds["act"] / 2**20,
            "temporaries_mib": kinds["temp"] / 2**20,
            "total_mib": kinds["total"] / 2**20,
            "rss_above_start_mib": summary.memory_above_start[0] / 2**20,
            "step_s": summary.median_s,
        }
    base = rows["baseline"]
    print(f"{args.model} tp={args.tp} batch {args.batch} x seq {args.seq}, fp32, rank 0, MiB (x baseline)")
    print(f"{'setting':<22} {'activations':>16} {'temporaries':>12} {'total at peak':>18} {'RSS above start':>18}")
    for name, row in rows.items():
        act, total, rss = row["activations_mib"], row["total_mib"], row["rss_above_start_mib"]
        print(
            f"{name:<22} {act:>8.0f} ({act / base['activations_mib']:.2f}x) {row['temporaries_mib']:>12.0f} "
            f"{total:>9.0f} ({total / base['total_mib']:.2f}x) {rss:>9.0f} ({rss / base['rss_above_start_mib']:.2f}x)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    run_main(main, "memory_features.py")
