"""mtk's contenders in ``mtk bench`` — one training step (forward, backward, AdamW step) of a layout — and
the registry of every contender, mtk's and its peers' (:mod:`mtk.bench.peers`). Each ``run_*`` function
runs inside the processes ``mtk.spawn`` starts (one per rank, gloo on CPU) and returns what it measured
on that rank (:mod:`mtk.bench.measure`).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import torch
import torch.distributed as dist

from mtk.bench.measure import (
    BenchSpec,
    RankResult,
    bench_batch,
    bench_device,
    count_model_state,
    live_peaks,
    measure_model,
    measure_step,
    resident_memory,
    synchronize,
    train_step,
)
from mtk.bench.peers import (
    run_accelerate,
    run_autoep,
    run_autotp,
    run_hf,
    run_mtk_accelerator,
    run_torch_pipelining,
    run_tp_plan,
    run_zero1,
    run_zero2,
)
from mtk.config import RunSettings
from mtk.convert import parallelize
from mtk.models import DTYPES, build_model
from mtk.parallel.context import attach_context_parallel
from mtk.parallel.expert_parallel import is_expert_parallel, reduce_expert_gradients
from mtk.parallel.fsdp import ShardingSettings, data_parallel_mesh, shard_over_data_parallel
from mtk.parallel.grads import all_reduce_coalesced, sum_tp_shared_grads_at_step, sync_sequence_parallel_grads
from mtk.parallel.recompute import enable_recompute
from mtk.parallel.record import parallelized
from mtk.parallel.state import ParallelState
from mtk.pipeline.engine import PipelineModel

__all__ = ["BenchSpec", "RankResult", "CONTENDERS", "run_mtk"]


def run_mtk(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """mtk: the HF model converted by the rules (TP), cut into stages (PP)."""
    torch.set_num_threads(spec.threads)
    device = bench_device()
    baseline = resident_memory(device)
    parallel = ParallelState.build(
        tp_size=spec.tp_size,
        pp_size=spec.pp_size,
        cp_size=spec.cp_size,
        ep_size=spec.ep_size,
        etp_size=spec.etp_size,
        device=device,
    )
    model = build_model(spec.model, seed=spec.seed, dtype=DTYPES[spec.dtype])
    parallelize(
        model,
        parallel,
        sequence_parallel=spec.sequence_parallel,
        pipeline_layers=spec.pipeline_layers,
        virtual_stages=spec.virtual_stages,
        loss_chunk_tokens=spec.loss_chunk_tokens,
    )
    record = parallelized(model)
    enable_recompute(model, RunSettings(recompute_granularity=spec.recompute), record.rng if record else None)
    sum_tp_shared_grads_at_step(model, parallel.tp_group)  # as the Accelerator: once per step, after backward
    if spec.cp_size > 1:
        return _run_context_parallel(spec, model, parallel, device, baseline)

    def sync_sequence_parallel() -> None:  # what the Accelerator does after backward (SP's and tp_shared gradients)
        sync_sequence_parallel_grads(model, parallel.tp_group)

    def sync_grads() -> None:  # and the DP average (DDP's job in the Accelerator; here one coalesced call)
        sync_sequence_parallel()
        dense = [p.grad for p in model.parameters() if p.grad is not None and not is_expert_parallel(p)]
        all_reduce_coalesced(dense, parallel.dp_group, average=True)
        if spec.ep_size > 1:  # the experts over the ranks holding the same ones, as the Accelerator's backward
            reduce_expert_gradients(list(model.parameters()), parallel.expert_replica_group, parallel.dp_size)

    def sync_sharded() -> None:  # FSDP2 reduce-scattered in backward; TP's shared gradients, as the Accelerator
        sync_sequence_parallel_grads(model, parallel.tp_group)

    if spec.fsdp:  # FSDP2 over DP as the Accelerator shards it
        sharding = ShardingSettings(dp_shard_size=parallel.dp_size)
        shard_over_data_parallel(model.to(device), data_parallel_mesh(parallel, sharding), sharding)
    if spec.pp_size == 1:
        shard_over = parallel.dp_group if spec.distributed_optimizer else None
        after_backward = sync_sharded if spec.fsdp else sync_grads
        experts_over = parallel.expert_replica_group if spec.distributed_optimizer else None
        measured = measure_model(spec, model.to(device), device, after_backward, baseline, shard_over, experts_over)
        if spec.ep_size > 1:
            _mean_exchange_bytes(measured, parallel)
        if parallel.dp_size > 1 and not spec.fsdp:
            measured["reduction_s"] = _reduction_seconds(model, parallel.dp_group, device)
        if parallel.tp_size > 1:
            hidden = cast(Any, model).config.hidden_size
            measured["activation_all_reduce_s"] = _activation_all_reduce_seconds(spec, hidden, parallel, device)
        return measured
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    pipe = PipelineModel(model, parallel, spec.micro_batches, spec.pipeline_schedule)
    schedules = []  # every call's PipelineStats; the last spec.steps are the timed ones

    def forward(**batch):
        out = pipe(**batch)
        schedules.append(pipe.stats)
        pipe.finalize_grads()
        sync_sequence_parallel()
        return out

    step = train_step(
        forward, optimizer, bench_batch(spec, cast(Any, model).config.vocab_size, device), backward=False
    )
    result = measure_step(spec, step, device, baseline)
    timed = schedules[-spec.steps :]
    result.pipeline_schedule_s = sum(s.total_s for s in timed)
    result.pipeline_busy_s = sum(s.busy_s for s in timed)
    result.model_state = count_model_state(model, optimizer)
    if spec.track_memory:  # MemTracker refuses modules run once per micro-batch: live bytes only
        result.memory_by_kind = live_peaks(model, optimizer, step)
    return result.as_dict()


def _mean_exchange_bytes(measured: dict, parallel: ParallelState) -> None:
    """The all-to-alls' bytes as the EP group's mean: routing decides how many rows each rank's experts take (and
    send back), and only the group's total is fixed (:func:`~mtk.planner.collectives.predict_expert_collectives`)."""
    exchanged = measured["collectives"].get("all_to_all")
    total = torch.tensor([exchanged["bytes"] if exchanged else 0], dtype=torch.int64, device=parallel.device)
    dist.all_reduce(total, group=parallel.ep_group)
    if exchanged:
        exchanged["bytes"] = int(total) // parallel.ep_size


def _run_context_parallel(spec: BenchSpec, model, parallel: ParallelState, device, baseline: int) -> dict:
    """One replica whose every TP rank's sequence is split over ``spec.cp_size`` ranks; each rank backpropagates
    ``cp`` times its share of the batch's loss, so the gradients are averaged over the CP group after backward, as
    the Accelerator's DDP does over the DP x CP replicas."""
    cp_group = parallel.cp_group
    attach_context_parallel(model, cp_group, spec.cp_comm)

    def after_backward() -> None:
        sync_sequence_parallel_grads(model, parallel.tp_group)
        all_reduce_coalesced([p.grad for p in model.parameters() if p.grad is not None], cp_group, average=True)

    return measure_model(spec, model.to(device), device, after_backward, baseline)


def _activation_all_reduce_seconds(spec: BenchSpec, hidden: int, parallel, device: torch.device) -> float:
    """One TP all-reduce of a ``[b, s, h]`` activation, every rank starting together (median of 20): what the
    TP floor charges per all-reduce."""
    activation = torch.zeros(spec.batch, spec.seq, hidden, dtype=DTYPES[spec.dtype], device=device)  # [b, s, h]
    dist.all_reduce(activation, group=parallel.tp_group)  # warm-up
    times = []
    for _ in range(20):
        dist.barrier(group=parallel.tp_group)
        start = time.perf_counter()
        dist.all_reduce(activation, group=parallel.tp_group)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _reduction_seconds(model, group, device: torch.device) -> float:
    """The DP average of a buffer the size of this rank's gradients, every rank starting together: the
    reduction a data-parallel step adds to one replica's step."""
    buffers = [torch.zeros_like(p) for p in model.parameters() if p.requires_grad]
    all_reduce_coalesced(buffers, group, average=True)  # warm-up (connections, allocation)
    dist.barrier()
    start = time.perf_counter()
    all_reduce_coalesced(buffers, group, average=True)
    synchronize(device)
    return time.perf_counter() - start


def run_mtk_one_replica(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """mtk at the same TP x PP as one data-parallel replica: what a DP layout's ideal is measured from."""
    return run_mtk(rank, world_size, replace(spec, dp_size=1, ep_size=1, distributed_optimizer=False, fsdp=False))


def run_mtk_without_ep(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """mtk at the same layout with every expert on every replica: what expert parallelism is held against."""
    return run_mtk(rank, world_size, replace(spec, ep_size=1))


def run_mtk_experts_split(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """mtk at the same layout with each expert split over TP (the experts' TP size the TP size): what keeping the
    experts whole and splitting the tokens (``--etp 1``) is held against."""
    return run_mtk(rank, world_size, replace(spec, etp_size=None))


def run_mtk_one_stage(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """mtk at the same TP with the whole model on one stage: what a pipeline's ideal is measured from."""
    one_stage = replace(
        spec, pp_size=1, micro_batches=1, pipeline_layers=(), pipeline_schedule="1f1b", virtual_stages=1
    )
    return run_mtk(rank, world_size, one_stage)


# name -> (worker, processes for a spec, threads per process or None for the spec's)
CONTENDERS: dict[str, tuple[Callable, Callable[[BenchSpec], int], Callable[[BenchSpec], int]]] = {
    "mtk": (run_mtk, lambda s: s.tp_size * s.cp_size * s.pp_size * s.dp_size, lambda s: 1),
    "mtk-one-stage": (run_mtk_one_stage, lambda s: s.tp_size * s.dp_size, lambda s: 1),
    "mtk-one-replica": (run_mtk_one_replica, lambda s: s.tp_size * s.pp_size, lambda s: 1),
    "mtk-without-ep": (run_mtk_without_ep, lambda s: s.tp_size * s.dp_size, lambda s: 1),
    "mtk-experts-split": (run_mtk_experts_split, lambda s: s.tp_size * s.pp_size * s.dp_size, lambda s: 1),
    "hf-1thread": (run_hf, lambda s: 1, lambda s: 1),
    "accelerate": (run_accelerate, lambda s: 1, lambda s: 1),
    "mtk-accelerator": (run_mtk_accelerator, lambda s: 1, lambda s: 1),
    "hf-all-threads": (run_hf, lambda s: 1, lambda s: os.cpu_count() or 1),
    "transformers-tp_plan": (run_tp_plan, lambda s: s.tp_size, lambda s: 1),
    "deepspeed-autotp": (run_autotp, lambda s: s.tp_size, lambda s: 1),
    "deepspeed-autoep": (run_autoep, lambda s: s.dp_size, lambda s: 1),
    "torch-pipelining": (run_torch_pipelining, lambda s: s.pp_size, lambda s: 1),
    "deepspeed-zero1": (run_zero1, lambda s: s.dp_size, lambda s: 1),
    "deepspeed-zero2": (run_zero2, lambda s: s.dp_size, lambda s: 1),
}
