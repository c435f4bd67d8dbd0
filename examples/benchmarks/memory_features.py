"""Per-rank memory of one training step with sequence parallelism and activation recomputation on and off.

    python examples/benchmarks/memory_features.py                       # bench-llama, TP=2, batch 2 x seq 1024
    python examples/benchmarks/memory_features.py --seq 2048 --json mem.json

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

import torch

from mtk.bench.measure import BenchSpec, track_memory_by_kind
from mtk.bench.runner import run_bench
from mtk.spawn import run_distributed
from mtk.training.entry import run_main

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
    optimizer_rows = optimizer_state_table(args.model)
    print(f"\n{args.model} tp=1 dp=2, fp32, rank 0, MiB (x replicated)")
    print(f"{'optimizer':<22} {'state':>16} {'at the peak (+ all-gather buffers)':>36}")
    plain = optimizer_rows["AdamW, replicated"]
    for name, row in optimizer_rows.items():
        state, peak = row["state_mib"], row["optimizer_at_peak_mib"]
        print(
            f"{name:<22} {state:>8.1f} ({state / plain['state_mib']:.2f}x) "
            f"{peak:>26.1f} ({peak / plain['optimizer_at_peak_mib']:.2f}x)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "optimizer_state_dp2_mib": optimizer_rows}, f, indent=2)


def optimizer_state_worker(rank: int, world_size: int, model_name: str, distributed: bool) -> dict[str, int]:
    """TP=1 x DP=2: one AdamW step with gradients averaged over DP, then one step under MemTracker."""
    from mtk.convert import parallelize
    from mtk.models import build_model
    from mtk.parallel.distributed_optimizer import shard_optimizer
    from mtk.parallel.grads import all_reduce_coalesced
    from mtk.parallel.state import ParallelState

    torch.set_num_threads(1)
    parallel = ParallelState.build(tp_size=1)
    model = parallelize(build_model(model_name, seed=0), parallel).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if distributed:
        shard_optimizer(optimizer, parallel.dp_group)
    ids = torch.randint(0, model.config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(rank))

    def step() -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        all_reduce_coalesced([p.grad for p in model.parameters()], parallel.dp_group, average=True)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    step()
    kinds = track_memory_by_kind(model, optimizer, step)
    kinds["state"] = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values())
    return kinds


def optimizer_state_table(model_name: str) -> dict[str, dict[str, float]]:
    """Optimizer state per rank (MiB) at DP=2, with and without the distributed optimizer: the state
    itself, and MemTracker's optimizer memory at the step's peak (with the all-gather's buffers)."""
    rows = {}
    for name, distributed in (("AdamW, replicated", False), ("distributed optimizer", True)):
        kinds = run_distributed(optimizer_state_worker, world_size=2, args=(model_name, distributed))[0]
        rows[name] = {"state_mib": kinds["state"] / 2**20, "optimizer_at_peak_mib": kinds["opt"] / 2**20}
    return rows


if __name__ == "__main__":
    run_main(main, "memory_features.py")
