"""Where one training step's peak CUDA memory goes: the allocator's trace at the peak, by the frame that allocated.

    python examples/benchmarks/cuda_peak_allocations.py                          # bench-llama, fp32, batch 4 x 1024
    python examples/benchmarks/cuda_peak_allocations.py --dtype bf16 --seq 2048

One process on one GPU: mtk's model at TP 1 (as ``mtk bench`` builds it), AdamW, two warm-up steps, then one
step under ``torch.cuda.memory._record_memory_history`` (:mod:`mtk.bench.allocations`). Prints max allocated,
what was allocated before the step, and the blocks live at the peak grouped by their frame.
"""

from __future__ import annotations

import argparse
import sys

import torch

from mtk.bench.allocations import peak_allocations
from mtk.bench.measure import BenchSpec, bench_batch, train_step
from mtk.convert import parallelize
from mtk.models import DTYPES, build_model
from mtk.parallel.state import ParallelState
from mtk.spawn import run_distributed


def _trace_step(rank: int, world_size: int, spec: BenchSpec, top: int) -> str:
    device = torch.device("cuda", torch.cuda.current_device())
    parallel = ParallelState.build(tp_size=1, pp_size=1, device=device)
    model = build_model(spec.model, seed=spec.seed, dtype=DTYPES[spec.dtype])
    parallelize(model, parallel)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = train_step(model, optimizer, bench_batch(spec, model.config.vocab_size, device))
    for _ in range(2):
        step()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    found = peak_allocations(snapshot["device_traces"][device.index])
    mib = 2**20
    lines = [
        f"{spec.model} {spec.dtype} batch {spec.batch} x seq {spec.seq}: max allocated "
        f"{torch.cuda.max_memory_allocated(device) / mib:.1f} MiB = {before / mib:.1f} MiB held before the step "
        f"(weights, AdamW state) + {found.peak / mib:.1f} MiB allocated in it and live at its peak:"
    ]
    lines += [f"  {size / mib:9.1f} MiB  {frame}" for frame, size in found.by_frame.most_common(top)]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-llama")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--top", type=int, default=15, help="frames to print")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cuda_peak_allocations.py: reads CUDA's allocator, and this machine has no CUDA device", file=sys.stderr)
        return 1
    spec = BenchSpec(model=args.model, tp_size=1, pp_size=1, batch=args.batch, seq=args.seq, steps=1, dtype=args.dtype)
    print(run_distributed(_trace_step, world_size=1, args=(spec, args.top), backend=None)[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
