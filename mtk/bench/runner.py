"""Run the contenders in interleaved rounds and summarize them.

The machine is shared and noisy: contenders take turns (round 1: mtk, HF, ...; round 2 in rotated
order ...), so a slow minute hurts all of them alike, and each is reported by its median and minimum
step time over every round. Before each launch, while none of the bench's processes run, the share of
CPU time the machine spent busy over half a second is sampled (``/proc/stat``): that is what other
work took from the contenders.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, cast

from mtk.bench.contenders import CONTENDERS, BenchSpec
from mtk.errors import allocation_failure
from mtk.models import attention_heads, build_model, num_layers, resolve_config
from mtk.models import element_size as dtype_size
from mtk.pipeline.balance import layer_counts, rank_layers
from mtk.planner.collectives import (
    Predicted,
    predict_collectives,
    predict_context_collectives,
    predict_expert_collectives,
)
from mtk.planner.shapes import (
    data_parallel_traffic,
    fsdp_traffic,
    has_residual_dropout,
    router_experts,
    sequence_parallel_elements,
    stage_moe_layers,
    tp_shared_numels,
)
from mtk.spawn import DistributedTestError, run_distributed

__all__ = ["ContenderSummary", "machine_busy_fraction", "run_bench"]


@dataclass
class ContenderSummary:
    """One contender over all rounds."""

    name: str
    processes: int
    threads: int
    step_s: list[float] = field(default_factory=list)  # per step: the slowest rank's time
    peak_memory: list[int] = field(default_factory=list)  # per rank: the largest over rounds
    memory_above_start: list[int] = field(default_factory=list)  # per rank: the largest over rounds
    memory_by_kind: list[dict[str, int]] = field(default_factory=list)  # per rank, when tracked
    model_state: list[dict[str, int]] = field(default_factory=list)  # per rank: weights, gradients, optimizer
    pipeline_busy_s: list[float | None] = field(default_factory=list)  # per rank, pp > 1: not waiting (last round)
    pipeline_schedule_s: list[float | None] = field(default_factory=list)  # per rank, pp > 1: schedules (last round)
    reduction_s: list[float | None] = field(default_factory=list)  # per rank, dp > 1: one DP all-reduce (last round)
    activation_all_reduce_s: list[float | None] = field(default_factory=list)  # per rank, tp > 1 (last round)
    loss: float | None = None
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)  # rank 0, one step
    error: str | None = None

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.step_s) if self.step_s else None

    @property
    def min_s(self) -> float | None:
        return min(self.step_s) if self.step_s else None

    def add(self, ranks: list[dict]) -> None:
        self.step_s += [max(times) for times in zip(*(r["step_s"] for r in ranks))]
        memory = [r["peak_memory"] for r in ranks]
        self.peak_memory = [max(a, b) for a, b in zip(self.peak_memory, memory)] if self.peak_memory else memory
        self.memory_by_kind = [r["memory_by_kind"] for r in ranks]  # the last round's
        self.model_state = [r["model_state"] for r in ranks]
        self.pipeline_busy_s = [r.get("pipeline_busy_s") for r in ranks]
        self.pipeline_schedule_s = [r.get("pipeline_schedule_s") for r in ranks]
        self.reduction_s = [r.get("reduction_s") for r in ranks]
        self.activation_all_reduce_s = [r.get("activation_all_reduce_s") for r in ranks]
        grown = [r["memory_above_start"] for r in ranks]
        old = self.memory_above_start
        self.memory_above_start = [max(a, b) for a, b in zip(old, grown)] if old else grown
        self.loss = ranks[-1]["loss"]  # the last rank holds the loss under PP
        self.collectives = self.collectives or ranks[0]["collectives"]


def predicted_for(spec: BenchSpec) -> Predicted:
    config = resolve_config(spec.model)
    layers = num_layers(config)
    replicas = spec.cp_size if spec.cp_size > 1 else spec.dp_size  # CP ranks sum their gradients in one call
    dp_traffic = (
        {}
        if spec.fsdp
        else data_parallel_traffic(
            config, spec.tp_size, replicas, spec.distributed_optimizer, spec.ep_size, spec.etp_size
        )
    )
    stage_layers = _first_rank_layers(config, spec) if spec.pp_size > 1 else layers
    moe_here = stage_moe_layers(config, stage_layers, spec.pp_size)  # rank 0's
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    element_size = dtype_size(spec.dtype)
    predicted = predict_collectives(
        layers,
        config.hidden_size,
        spec.batch,
        spec.seq // spec.cp_size,  # what each rank's layers see
        spec.tp_size,
        pp_size=spec.pp_size,
        micro_batches=spec.micro_batches,
        element_size=element_size,
        sequence_parallel=spec.sequence_parallel and spec.tp_size > 1,
        sequence_parallel_elements=sequence_parallel_elements(config, spec.tp_size) if spec.sequence_parallel else 0,
        recompute=spec.recompute,
        residual_dropout=has_residual_dropout(config),
        virtual_stages=spec.virtual_stages,
        stage_layers=_first_rank_layers(config, spec) if spec.pp_size > 1 else None,
        tp_summed_at_step_numels=(  # mtk's contender sums them once per step, as the Accelerator
            tuple(tp_shared_numels(config, spec.tp_size, spec.etp_size, spec.ep_size)) * stage_layers
            if spec.tp_size > 1
            else ()
        ),
        moe_layers=moe_here if spec.tp_size > 1 else 0,
        top_k=top_k,
        router_experts=router_experts(config) if spec.pp_size > 1 else 0,
        experts_whole=spec.etp_size == 1,
        **dp_traffic,
    )
    tokens = spec.batch // spec.micro_batches * spec.seq  # a micro-batch's, each TP rank's share at the experts' TP 1
    exchange = predict_expert_collectives(
        moe_here,
        -(-tokens // spec.tp_size) if spec.etp_size == 1 else tokens,
        top_k,
        config.hidden_size,
        spec.ep_size,
        element_size,
        recompute=spec.recompute is not None,
        micro_batches=spec.micro_batches,
    )
    predicted.counts.update(exchange.counts)
    predicted.nbytes.update(exchange.nbytes)
    if spec.fsdp:  # FSDP2's gathers and reduce-scatters, per unit
        for kind, moved in fsdp_traffic(config, spec.tp_size, spec.dp_size, element_size).items():
            predicted.counts[kind] += moved["count"]
            predicted.nbytes[kind] += moved["bytes"]
    if spec.cp_size > 1:
        heads, kv_heads, head_dim = attention_heads(config)
        context = predict_context_collectives(
            layers,
            spec.batch,
            spec.seq,
            spec.cp_size,
            spec.cp_comm,
            heads // spec.tp_size,
            max(1, kv_heads // spec.tp_size),  # tp beyond the kv heads: one (replicated) per rank
            head_dim,
            element_size,
            recompute=spec.recompute is not None,
            losses=spec.micro_batches,
            router_experts=router_experts(config),
        )
        predicted.counts.update(context.counts)  # Counter.update adds
        predicted.nbytes.update(context.nbytes)
    return predicted


def _first_rank_layers(config, spec: BenchSpec) -> int:
    """Decoder blocks on rank 0 (whose collectives the bench counts): its chunks' share of the split the run
    uses (``spec.pipeline_layers``, else mtk's default)."""
    counts = layer_counts(config, spec.pp_size * spec.virtual_stages, spec.pipeline_layers)
    return rank_layers(counts, spec.pp_size)[0]


def run_bench(
    spec: BenchSpec,
    contenders: list[str],
    rounds: int,
    progress: Callable[[str], None] = print,
    timeout: float = 600,
    fork_workers: bool = False,
) -> tuple[list[ContenderSummary], list[float]]:
    """Run ``contenders`` for ``rounds`` interleaved rounds; returns their summaries and the busy
    share of the machine sampled before each launch.

    Each launch's workers start as fresh interpreters, so that a rank's peak RSS (the memory column on CPU) is its
    own; ``fork_workers`` forks them (gloo, CPU) from a server that imported torch once: seconds faster per launch,
    the RSS then counting pages shared with the server (live bytes, ``track_memory``, are unaffected)."""
    summaries = {
        name: ContenderSummary(name, CONTENDERS[name][1](spec), CONTENDERS[name][2](spec)) for name in contenders
    }
    loads: list[float] = []
    with tempfile.TemporaryDirectory(prefix="mtk-bench-") as tmp:
        if any(name == "transformers-tp_plan" for name in contenders):  # the same weights, as a local HF dir
            cast(Any, build_model(spec.model, seed=spec.seed)).save_pretrained(tmp)
            spec = replace(spec, checkpoint_dir=tmp)
        total, done = rounds * len(contenders), 0
        for round_index in range(rounds):
            shift = round_index % len(contenders)
            for name in contenders[shift:] + contenders[:shift]:
                summary = summaries[name]
                done += 1
                if summary.error:
                    continue
                worker, _, _ = CONTENDERS[name]
                loads.append(machine_busy_fraction())
                start = time.perf_counter()
                try:
                    ranks = run_distributed(
                        worker,
                        world_size=summary.processes,
                        args=(replace(spec, threads=summary.threads),),
                        timeout=timeout,
                        backend="gloo" if fork_workers else None,  # None: gloo on CPU, NCCL on CUDA
                    )
                except DistributedTestError as err:
                    oom = allocation_failure(err, "use a smaller --batch or --seq")  # (sizes, not a bug)
                    summary.error = str(oom) if oom else _last_line(str(err))
                    if "allowed ran out" in summary.error:  # the user's --timeout, before a hang
                        summary.error += f"; raise --timeout ({timeout:g} s) if the launch only needs longer"
                    progress(f"[{done}/{total}] {name}: failed ({summary.error})")
                    continue
                summary.add(ranks)
                progress(
                    f"[{done}/{total}] round {round_index + 1} {name}: median {summary.median_s:.3f} s/step "
                    f"({time.perf_counter() - start:.0f} s with start-up)"
                )
    return list(summaries.values()), loads


def _cpu_times() -> tuple[int, int] | None:
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields), idle


def machine_busy_fraction(interval: float = 0.5) -> float:
    """Share of all cores' time spent busy during ``interval`` (the 1-minute load average / cores
    where ``/proc/stat`` is missing)."""
    before = _cpu_times()
    if before is None:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    time.sleep(interval)
    after = _cpu_times()
    if before is None or after is None:
        return 0.0
    total, idle = after[0] - before[0], after[1] - before[1]
    return (total - idle) / total if total else 0.0


def _last_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "unknown error"
