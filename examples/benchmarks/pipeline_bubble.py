"""Measure the pipeline bubble: idle share of each stage's step, next to (p - 1) / (v m + p - 1).

    python examples/benchmarks/pipeline_bubble.py                       # PP=2, m = 1, 2, 4, 8: afab, 1f1b, interleaved
    python examples/benchmarks/pipeline_bubble.py --pp 2 --micro 4 8 16 --layers 8 --hidden 256 --virtual_stages 2

Each of ``pp`` processes (one thread each) runs one stage of a Llama built from the flags (interleaved:
``--virtual_stages`` chunks per stage, where ``m`` is a multiple of ``pp``). A step is the full schedule
(forward and backward of every micro-batch) on a fixed global batch, every stage starting after a
barrier. A stage's idle share is the part of the step (the slowest stage's schedule) it spent not
computing — blocked on a neighbour, or done early; the bubble is the slowest stage's idle share (a
faster stage also idles for the imbalance), median over steps. The formula assumes equal
forward/backward times on every stage.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig

from mtk.convert import parallelize
from mtk.models import build_model
from mtk.parallel import ParallelState
from mtk.pipeline.engine import PipelineModel
from mtk.pipeline.schedules import bubble_fraction
from mtk.spawn import run_distributed
from mtk.training.entry import run_main


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages = processes (default 2)")
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4, 8], help="micro-batch counts to try")
    parser.add_argument("--micro_batch_size", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per setting (after one warm-up)")
    parser.add_argument("--virtual_stages", type=int, default=2, help="chunks per stage for the interleaved rows")
    args = parser.parse_args(argv)
    if args.virtual_stages < 2:
        parser.error(f"--virtual_stages {args.virtual_stages}: the interleaved rows need at least 2 chunks per stage")
    return args


def _config(args) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64 or 64,
        num_hidden_layers=args.layers,
        num_attention_heads=max(args.hidden // 64, 1),
        num_key_value_heads=max(args.hidden // 128, 1),
        max_position_embeddings=args.seq,
    )


def _measure(rank: int, world_size: int, args, schedule: str, micro: int) -> dict:
    parallel = ParallelState.build(pp_size=world_size)
    model = build_model(_config(args), seed=0)
    parallelize(model, parallel, virtual_stages=args.virtual_stages if schedule == "interleaved" else 1)
    pipe = PipelineModel(model, parallel, micro, schedule)
    ids = torch.randint(0, 1024, (micro * args.micro_batch_size, args.seq), generator=torch.Generator().manual_seed(0))
    busy, schedules = [], []
    for step in range(args.steps + 1):
        torch.distributed.barrier()
        start = time.perf_counter()
        pipe(input_ids=ids, labels=ids)
        elapsed = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        if step:  # the first step warms up allocations
            busy.append(elapsed - pipe.stats.wait_s)
            schedules.append(elapsed)
    return {"busy_s": busy, "step_s": schedules}


def main(argv=None) -> None:
    args = parse_args(argv)
    print(
        f"pipeline bubble: pp={args.pp}, Llama {args.layers} layers x hidden {args.hidden}, seq {args.seq}, "
        f"micro-batch {args.micro_batch_size}, 1 thread per stage, median of {args.steps} steps"
    )
    print(f"{'schedule':>8} {'m':>3} {'step s':>8} {'s/micro':>8} {'bubble':>7} {'formula':>8}  per stage")
    for micro in args.micro:
        for schedule in ("afab", "1f1b", "interleaved"):
            if schedule == "interleaved" and micro % args.pp:
                continue
            v = args.virtual_stages if schedule == "interleaved" else 1
            results = run_distributed(_measure, world_size=args.pp, args=(args, schedule, micro), timeout=600)
            steps = [max(times) for times in zip(*(r["step_s"] for r in results))]  # the slowest stage's
            stages = [statistics.median(1 - b / s for b, s in zip(r["busy_s"], steps)) for r in results]
            step = statistics.median(steps)
            name = f"{schedule[:5]} v{v}" if v > 1 else schedule
            print(
                f"{name:>8} {micro:>3} {step:>8.3f} {step / micro:>8.3f} {min(stages):>7.1%} "
                f"{bubble_fraction(args.pp, micro, v):>8.1%}  " + " ".join(f"{s:.1%}" for s in stages),
                flush=True,
            )


if __name__ == "__main__":
    run_main(main, "pipeline_bubble.py")
