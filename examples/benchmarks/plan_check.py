"""Hold ``mtk plan`` against measured runs: per rank, the predicted peak memory next to the measured one.

    python examples/benchmarks/plan_check.py                  # every layout of mtk.bench.plan_check.CHECKED_LAYOUTS
    python examples/benchmarks/plan_check.py --json out.json

Each layout runs ``mtk bench``'s mtk contender (fp32; gloo on CPU, NCCL on CUDA) with the live-byte counter on
(max allocated on CUDA) and compares each rank with the planner's prediction for its stage; the model state
(weights, gradients, AdamW moments) must be exact. docs/plan.md keeps the latest table.
"""

from __future__ import annotations

import argparse
import json

from mtk.bench.contenders import BenchSpec
from mtk.bench.plan_check import CHECKED_LAYOUTS, check_ranks, planned_collectives
from mtk.bench.runner import run_bench
from mtk.parallel.state import default_device


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    device = default_device().type
    rows = []
    header = f"{'layout':<28} {'rank':>4} {'stage':>5} {'measured MiB':>12} {'planned MiB':>11} {'ratio':>6}"
    print(header + "  state  collectives")
    for name, layout in CHECKED_LAYOUTS.items():
        spec = BenchSpec(steps=1, track_memory=True, **layout)
        (summary,), _ = run_bench(spec, ["mtk"], 1, progress=lambda line: None, timeout=1800)
        if summary.error:
            raise SystemExit(f"{name}: {summary.error}")
        same = summary.collectives == planned_collectives(spec, device)
        for check in check_ranks(spec, summary, device):
            rows.append({"layout": name, "rank": check.rank, "stage": check.stage, "ratio": check.ratio,
                         "measured": check.measured_peak, "planned": check.predicted.peak,
                         "state_exact": check.state_exact, "collectives_equal": same})  # fmt: skip
            state, traffic = "exact" if check.state_exact else "DIFF", "equal" if same else "DIFFER"
            print(
                f"{name:<28} {check.rank:>4} {check.stage:>5} {check.measured_peak / 2**20:>12.1f} "
                f"{check.predicted.peak / 2**20:>11.1f} {check.ratio:>6.3f}  {state:<5}  {traffic}"
            )
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    print(f"largest error: {worst['ratio'] - 1:+.1%} ({worst['layout']}, rank {worst['rank']})")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
