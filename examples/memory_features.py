"""Per-rank memory of one training step with sequence parallelism and activation recomputation on and off.

    python examples/memory_features.py                       # bench-llama, TP=2, batch 2 x seq 1024
    python examples/memory_features.py --seq 2048 --json mem.json

Each setting runs ``mtk bench``'s mtk contender (a real TP run with an AdamW step) in fresh processes and
reports, per rank, the peak memory above what the process held before the model was built (CPU: peak
RSS; CUDA: max allocated), next to the baseline (neither feature) of the same run. The difference
between settings is activation memory: weights, gradients and optimizer state are the same in all.
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
        )
        (summary,), _ = run_bench(spec, ["mtk"], 1, progress=lambda line: None, timeout=1800)
        if summary.error:
            raise SystemExit(f"{name}: {summary.error}")
        rows[name] = {"memory_above_start_mib": max(summary.memory_above_start) / 2**20, "step_s": summary.median_s}
    base = rows["baseline"]["memory_above_start_mib"]
    print(f"{args.model} tp={args.tp} batch {args.batch} x seq {args.seq}, fp32: peak memory per rank above the start")
    print(f"{'setting':<22} {'MiB':>8} {'vs baseline':>12} {'s/step':>8}")
    for name, row in rows.items():
        mib = row["memory_above_start_mib"]
        print(f"{name:<22} {mib:>8.0f} {mib / base:>11.2f}x {row['step_s']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    run_main(main, "memory_features.py")
