"""Enumerate the layouts of a model on a cluster, estimate each, keep those that fit, fastest first.

A layout is TP x PP x DP with a micro-batch size, the pipeline schedule (1F1B, or interleaved 1F1B over ``v``
model chunks per rank), sequence parallelism, activation recomputation and the optimizer's sharding (mtk's
distributed optimizer under accelerate; ZeRO 1/2/3 under DeepSpeed, which runs TP x ZeRO-DP without a
pipeline). The rules mtk enforces when it runs are the rules here: TP divides the heads
(:func:`mtk.rules.check_tp_size`) and stays inside a node, PP divides the layers, interleaving needs the
layers to divide into ``p v`` chunks (Megatron's constraint) and ``m`` a multiple of ``p``
(:func:`mtk.config.check_schedule`), DP divides the global batch, SP needs TP > 1 and a sequence TP divides
(and accelerate). Stages hold the layers mtk's runtime gives them (:func:`mtk.pipeline.balance.layer_counts`:
the last stage's LM head counted as layers), and the step is timed on the slowest rank, head included.

Recomputation and SP only ever add time or save memory, so for each layout the planner keeps the first
setting that fits in this order: no recompute, selective, full (SP on where it may be, since it costs no
time and saves memory); ``every_setting`` lists all of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

import torch
from transformers import PretrainedConfig

from mtk.config import check_schedule
from mtk.errors import MtkError
from mtk.models import element_size, num_layers
from mtk.parallel.layout import Layout
from mtk.parallel.overlap import gradient_buckets
from mtk.parallel.router_loss import router_loss_refusal
from mtk.pipeline.balance import head_weight, layer_counts, rank_layers
from mtk.pipeline.schedules import bubble_overhead
from mtk.planner.collectives import predict_collectives
from mtk.planner.context import attention_workspace, context_collectives, context_parallel_refusal, context_traffic
from mtk.planner.experts import expert_collectives, expert_parallel_sizes, expert_tp_sizes, expert_traffic
from mtk.planner.layouts import Candidate, Estimate, Request
from mtk.planner.memory import RankMemory, Training, stage_memory, stage_parameters
from mtk.planner.shapes import (
    all_gather_widths,
    has_residual_dropout,
    router_experts,
    sequence_parallel_elements,
    stage_moe_layers,
)
from mtk.planner.timing import StepTime, Traffic, collective_seconds, flops_per_token, model_size
from mtk.planner.trace import Parameters, TraceSettings, trace_rank
from mtk.rules import check_tp_size
from mtk.rules.registry import find_rules

__all__ = [
    "Candidate",
    "Estimate",
    "Request",
    "context_parallel_refusal",
    "estimate",
    "plan",
    "rank_memory",
    "stage_collectives",
]

RECOMPUTE_ORDER = (None, "selective", "full")
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def _rank_layers(config: PretrainedConfig, c: Candidate) -> list[int]:
    """Decoder layers per pipeline rank, as mtk's runtime splits them."""
    return rank_layers(layer_counts(config, c.pp_size * c.virtual_stages, c.pipeline_layers), c.pp_size)


def _rank_seq(request: Request, candidate: Candidate) -> int:
    """Tokens of each sequence one rank holds: the whole row, or its share under context parallelism."""
    return request.seq // candidate.cp_size


def _trace_settings(request: Request, candidate: Candidate) -> TraceSettings:
    return TraceSettings(
        tp_size=candidate.tp_size,
        sequence_parallel=candidate.sequence_parallel,
        recompute=candidate.recompute,
        lora_r=request.lora_r,
        lora_target_parameters=request.lora_target_parameters,
        dtype=request.dtype,
        device=request.device,
        chunked_loss=candidate.sharding != "zero3",  # ZeRO-3's partitioned head computes its logits (vocab_head.py)
        ep_size=candidate.ep_size,
        etp_size=candidate.etp_size,
    )


def estimate(request: Request, candidate: Candidate) -> Estimate:
    """Memory of every stage (the fullest is reported), traffic and step time of one candidate."""
    config, c = request.config, candidate
    trace = trace_rank(config, _trace_settings(request, c), _rank_seq(request, c), pipeline=c.pp_size > 1)
    counts = _rank_layers(config, c)
    memories = [rank_memory(request, c, s) for s in range(c.pp_size)]
    stage = max(range(c.pp_size), key=lambda s: memories[s].peak)
    params = stage_parameters(trace, counts[stage], stage, c.pp_size)
    traffic, collectives = _traffic(request, c, stage, params)
    time = _step_time(request, c, counts, traffic)
    fits = memories[stage].peak <= request.cluster.gpu_memory - request.reserve
    tokens_per_s = request.global_batch * request.seq / time.total
    return Estimate(c, memories[stage], stage, traffic, time, fits, tokens_per_s, collectives, tuple(memories))


def rank_memory(request: Request, candidate: Candidate, stage: int, dp_rank: int | None = None) -> RankMemory:
    """A TP rank of pipeline stage ``stage`` (of replica ``dp_rank``, its DP x CP index; default: the fullest)."""
    c = candidate
    trace = trace_rank(request.config, _trace_settings(request, c), _rank_seq(request, c), pipeline=c.pp_size > 1)
    training = Training(
        dtype=request.dtype,
        engine=c.engine,
        sharding=c.sharding,
        offload=c.offload,
        dp_size=c.replica_size,  # what gradients are reduced and optimizer state is sharded over
        lora=request.lora_r > 0,
        ddp=request.ddp and c.engine == "accelerate" and c.pp_size == 1,
        ep_size=c.ep_size,
    )
    return stage_memory(
        trace,
        training,
        layers=_rank_layers(request.config, c)[stage],
        stage=stage,
        pp_size=c.pp_size,
        micro_batch_size=c.micro_batch_size,
        micro_batches=c.micro_batches,
        virtual_stages=c.virtual_stages,
        dp_rank=dp_rank,
        attention_workspace=attention_workspace(request, c, _rank_seq(request, c)),
    )


def stage_collectives(request: Request, candidate: Candidate, stage: int) -> dict[str, dict[str, int]]:
    """The collectives mtk issues per step on a TP rank of pipeline stage ``stage``, by kind."""
    trace = trace_rank(
        request.config,
        _trace_settings(request, candidate),
        _rank_seq(request, candidate),
        pipeline=candidate.pp_size > 1,
    )
    layers = _rank_layers(request.config, candidate)[stage]
    params = stage_parameters(trace, layers, stage, candidate.pp_size)
    return _traffic(request, candidate, stage, params)[1]


def _traffic(request: Request, c: Candidate, stage: int, params: Parameters) -> tuple[Traffic, dict]:
    """Bytes per step of stage ``stage`` by group, their time on the wire, and mtk's collectives by kind
    (what ``mtk bench`` counts: TP and PP from :func:`predict_collectives`, the DP reduction and the
    distributed optimizer's all-gather rounds; DeepSpeed's own ZeRO calls are not mtk's). ``params``: the stage's
    trainable parameters' elements (which of them spread experts, under EP reduced and sharded over their
    ``dp*cp/ep`` replicas instead) and a LoRA base's frozen ones, which FSDP2 and ZeRO-3 gather too (not the spread
    experts among them: FSDP2 leaves those whole)."""
    numels, experts = list(params.trainable), params.expert_flags
    frozen = params.frozen - (params.frozen_experts if c.ep_size > 1 else 0)
    config, cluster = request.config, request.cluster
    predicted = predict_collectives(
        num_layers(config),
        config.hidden_size,
        c.micro_batch_size * c.micro_batches,
        _rank_seq(request, c),
        c.tp_size,
        pp_size=c.pp_size,
        stage=stage,
        micro_batches=c.micro_batches,
        virtual_stages=c.virtual_stages,
        stage_layers=_rank_layers(config, c)[stage],
        element_size=element_size(request.dtype),
        sequence_parallel=c.sequence_parallel,
        # the replicated parameters sequence parallelism sums over TP after backward: frozen under LoRA
        sequence_parallel_elements=(
            sequence_parallel_elements(config, c.tp_size) if c.sequence_parallel and request.lora_r == 0 else 0
        ),
        recompute=c.recompute,
        residual_dropout=has_residual_dropout(config),
        # DeepSpeed's ZeRO reduces in backward: every TP sum stays there (sum_tp_shared_grads_at_step)
        tp_summed_numels=(
            (params.tp_summed + (params.tp_summed_at_step if c.engine == "deepspeed" else ())) if c.tp_size > 1 else ()
        ),
        tp_summed_at_step_numels=params.tp_summed_at_step if c.tp_size > 1 and c.engine != "deepspeed" else (),
        gradient_element_size=element_size(request.dtype) if c.engine == "deepspeed" else 4,
        input_gradient=request.lora_r == 0,  # LoRA freezes the embedding
        moe_layers=stage_moe_layers(config, _rank_layers(config, c)[stage], c.pp_size) if c.tp_size > 1 else 0,
        top_k=int(getattr(config, "num_experts_per_tok", 0) or 0),
        router_experts=router_experts(config) if c.pp_size > 1 else 0,
        experts_whole=c.etp_size == 1,
    )
    layout = Layout(
        world_size=c.tp_size * c.cp_size * c.pp_size * c.dp_size,
        tp_size=c.tp_size,
        pp_size=c.pp_size,
        cp_size=c.cp_size,
        ep_size=c.ep_size,
    )
    spread = c.ep_size > 1 and any(experts)
    expert_numels = [n for n, expert in zip(numels, experts) if expert] if spread else []
    numels = [n for n, expert in zip(numels, experts or (False,) * len(numels)) if not (spread and expert)]
    # gradients and sharded state go over the DP x CP replicas
    tp_group, cp_group, pp_group, dp_group = (layout.groups(kind)[0] for kind in ("tp", "cp", "pp", "replica"))
    replicas = c.replica_size
    context = context_collectives(request, c, _rank_layers(config, c)[stage], element_size(request.dtype))
    cp_bytes, cp_s = context_traffic(context, request.cp_comm, c.cp_size, cluster.bandwidth(cp_group))
    tp_kinds = ("all_reduce", "all_gather", "reduce_scatter")
    tp_bytes = sum(predicted.nbytes[k] for k in tp_kinds)
    tp_s = sum(collective_seconds(k, predicted.nbytes[k], c.tp_size, cluster.bandwidth(tp_group)) for k in tp_kinds)
    pp_bytes = predicted.nbytes["send"]
    pp_s = collective_seconds("send", pp_bytes, c.pp_size, cluster.bandwidth(pp_group[:2])) if c.pp_size > 1 else 0.0
    grad_size = element_size(request.dtype) if c.engine == "deepspeed" else 4
    dp_bytes = sum(numels) * grad_size if replicas > 1 else 0
    dp_s = collective_seconds("all_reduce", dp_bytes, replicas, cluster.bandwidth(dp_group))
    if c.sharding == "zero3" and replicas > 1:  # every micro-batch gathers the parameters (a LoRA base's too) for
        # its forward and again for its backward, and reduce-scatters its gradients: the ZeRO paper's 1.5x of an
        # all-reduce, per micro-batch (DeepSpeed's own calls: not among mtk's collectives). Gathers are counted by
        # what each rank contributes, as FSDP2's below
        contributed = -(-(sum(numels) + frozen) * grad_size // replicas) * c.micro_batches
        scattered = dp_bytes * c.micro_batches
        bandwidth = cluster.bandwidth(dp_group)
        dp_s = 2 * collective_seconds("all_gather", contributed, replicas, bandwidth)
        dp_s += collective_seconds("reduce_scatter", scattered, replicas, bandwidth)
        dp_bytes = 2 * contributed * replicas + scattered
    if c.sharding == "fsdp2":  # every micro-batch gathers each unit for forward and backward, then reduce-scatters
        units = _rank_layers(request.config, c)[stage] + 1 + (c.pp_size > 1)  # layers, root, a stage's decoder
        base_size = element_size(request.dtype) if request.lora_r > 0 else 4  # a LoRA base stays in --dtype
        # all-gathers counted by what each rank contributes (its piece), reduce-scatters by their input
        pieces = -(-(sum(numels) * 4 + frozen * base_size) // replicas) * c.micro_batches if replicas > 1 else 0
        scattered = dp_bytes * c.micro_batches
        predicted.counts["all_gather"] += (2 * units - 1) * c.micro_batches  # the root is gathered once
        predicted.nbytes["all_gather"] += 2 * pieces
        predicted.counts["reduce_scatter"] += units * c.micro_batches
        predicted.nbytes["reduce_scatter"] += scattered
        bandwidth = cluster.bandwidth(dp_group)
        dp_s = 2 * collective_seconds("all_gather", pieces, replicas, bandwidth)
        dp_s += collective_seconds("reduce_scatter", scattered, replicas, bandwidth)
        dp_bytes = 2 * pieces * replicas + scattered  # gathered in, scattered out
    gathers = all_gather_widths(numels, replicas) if c.sharding == "distopt" else ()
    for width in gathers:  # the distributed optimizer's all-gather rounds of the updated weights
        dp_s += collective_seconds("all_gather", width * 4, replicas, cluster.bandwidth(dp_group))
    expert_replicas = replicas // c.ep_size
    expert_group = layout.groups("expert_replica")[0] if spread else dp_group
    expert_bytes = sum(expert_numels) * grad_size if expert_replicas > 1 else 0
    expert_gathers = all_gather_widths(expert_numels, expert_replicas) if c.sharding == "distopt" and spread else ()
    if spread:  # the experts' own reduction and all-gather rounds, over the replicas holding the same experts
        dp_s += collective_seconds("all_reduce", expert_bytes, expert_replicas, cluster.bandwidth(expert_group))
        for width in expert_gathers:
            dp_s += collective_seconds("all_gather", width * 4, expert_replicas, cluster.bandwidth(expert_group))
        if expert_bytes and c.engine == "accelerate":  # in DDP-sized buckets (DeepSpeed's reduction is its own)
            predicted.counts["all_reduce"] += len(
                gradient_buckets([(n * grad_size, torch.float32) for n in expert_numels])
            )
            predicted.nbytes["all_reduce"] += expert_bytes
        for width in expert_gathers:
            predicted.counts["all_gather"] += 1
            predicted.nbytes["all_gather"] += width * 4
    if replicas > 1 and c.engine == "accelerate" and c.sharding != "fsdp2":  # one coalesced all-reduce; under PP,
        # buckets from backward
        buckets = gradient_buckets([(n * grad_size, torch.float32) for n in numels]) if c.pp_size > 1 else [[]]
        predicted.counts["all_reduce"] += len(buckets)
        predicted.nbytes["all_reduce"] += dp_bytes
        for width in gathers:
            predicted.counts["all_gather"] += 1
            predicted.nbytes["all_gather"] += width * 4
    if c.cp_size > 1:  # counted with the rest (TP, PP and DP above are of the model's own collectives)
        predicted.counts.update(context.counts)
        predicted.nbytes.update(context.nbytes)
    dp_bytes += expert_bytes  # (the dense reduction's prediction above is of the dense gradients alone)
    exchange = expert_collectives(request, c, element_size(request.dtype), _rank_layers(config, c)[stage])
    ep_bytes, ep_s = expert_traffic(exchange, c.ep_size, cluster.bandwidth(layout.groups("ep")[0]))
    predicted.counts.update(exchange.counts)
    predicted.nbytes.update(exchange.nbytes)
    collectives = {k: {"count": predicted.counts[k], "bytes": predicted.nbytes[k]} for k in sorted(predicted.counts)}
    return Traffic(tp_bytes, pp_bytes, dp_bytes, tp_s, pp_s, dp_s, cp_bytes, cp_s, ep_bytes, ep_s), collectives


def _step_time(request: Request, c: Candidate, rank_layers: list[int], traffic: Traffic) -> StepTime:
    """The roofline of the slowest rank (``rank_layers``: decoder layers per pipeline rank; the last also runs
    the LM head, :func:`~mtk.pipeline.balance.head_weight` layers of work): module docstring of timing.py."""
    size = model_size(request.config)
    tokens = c.micro_batch_size * c.micro_batches * request.seq // c.cp_size  # per rank and step
    lora = request.lora_r > 0
    flops = flops_per_token(size, request.seq, lora=lora, recompute=c.recompute)
    head = head_weight(request.config)
    slowest = max(layers + (head if rank == c.pp_size - 1 else 0) for rank, layers in enumerate(rank_layers))
    share = tokens * slowest / (size.layers + head) / c.tp_size / request.cluster.peak_flops
    compute = flops * share
    # the ring passes each block on while the attention computes with it: only what outlasts the attention shows
    attention = (flops - flops_per_token(size, 0, lora=lora, recompute=c.recompute)) * share
    cp_exposed = max(0.0, traffic.cp_wire_s - attention) if request.cp_comm == "p2p" else traffic.cp_wire_s
    stage_s = compute + traffic.tp_wire_s
    bubble = bubble_overhead(c.pp_size, c.micro_batches, c.virtual_stages)
    # DDP / DeepSpeed reduce during the whole backward; a pipeline during its last micro-batch's backward;
    # the distributed optimizer's all-gather comes after the step
    backward = 2 / 3 * compute / (c.micro_batches if c.pp_size > 1 else 1)
    if c.sharding in ("fsdp2", "zero3"):  # every micro-batch's gathers and reduce-scatters hide under its compute
        backward = compute
    dp_exposed = traffic.dp_wire_s if c.sharding == "distopt" else max(0.0, traffic.dp_wire_s - backward)
    stage_s += cp_exposed + traffic.ep_wire_s  # the experts wait for their tokens: nothing hides the exchange
    total = stage_s * (1 + bubble) + traffic.pp_wire_s + dp_exposed
    return StepTime(
        compute,
        traffic.tp_wire_s,
        stage_s * bubble,
        traffic.pp_wire_s,
        dp_exposed,
        total,
        bubble,
        cp_exposed,
        traffic.ep_wire_s,
    )


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def valid_tp_sizes(request: Request) -> list[int]:
    """TP sizes that divide the heads (mtk's own check) and a node's GPUs."""
    sizes = []
    for tp in _divisors(request.cluster.gpus_per_node):
        try:
            check_tp_size(request.config, tp)
        except MtkError:
            continue
        sizes.append(tp)
    return sizes


def _sequence_parallel_rules(config: PretrainedConfig, tp_size: int) -> bool:
    """Whether the rules mtk picks take sequence parallelism: hand-written plans do; transformers' tp plans (not
    checked under SP) and the generic rules (no shared inputs to gather the sequence) do not, and mtk refuses SP
    with them."""
    rule_set = find_rules(config, tp_size)
    return rule_set is not None and rule_set.sequence_parallel and bool(rule_set.shared_inputs)


def _pipeline_supported(config: PretrainedConfig) -> bool:
    rule_set = find_rules(config)
    pipeline_rules = rule_set is not None and rule_set.pipeline is not None
    return pipeline_rules and router_loss_refusal(config, "pipeline parallelism") is None


def layouts(request: Request) -> Iterator[Candidate]:
    """Every (tp, cp, pp, dp, ep, micro-batch, engine, sharding) the rules allow, before SP and recompute."""
    for candidate in _dense_layouts(request):
        for ep in expert_parallel_sizes(request, candidate):
            for etp in expert_tp_sizes(request, replace(candidate, ep_size=ep)):
                yield replace(candidate, ep_size=ep, etp_size=etp)


def _dense_layouts(request: Request) -> Iterator[Candidate]:
    """:func:`layouts` with every expert on every replica (EP 1)."""
    cluster, layers = request.cluster, num_layers(request.config)
    tps = [request.tp_size] if request.tp_size else valid_tp_sizes(request)
    pipeline = _pipeline_supported(request.config)
    cps = request.cp_sizes if context_parallel_refusal(request.config) is None else (1,)
    for tp, cp in ((tp, cp) for tp in tps for cp in cps):
        if cluster.gpus % (tp * cp) or request.seq % (2 * cp):  # each rank takes 2 of 2 cp equal chunks
            continue
        for pp in _divisors(cluster.gpus // (tp * cp)):
            if (request.pp_size and pp != request.pp_size) or layers < pp or (pp > 1 and not pipeline):
                continue
            dp = cluster.gpus // (tp * cp * pp)
            if request.global_batch % dp:
                continue
            replica_batch = request.global_batch // dp
            for micro_batch_size in MICRO_BATCH_SIZES:
                if replica_batch % micro_batch_size:
                    continue
                shape = Candidate(tp, pp, dp, micro_batch_size, replica_batch // micro_batch_size, cp_size=cp)
                replicas = dp * cp  # distopt and FSDP2 shard over the DP x CP ranks
                if "accelerate" in request.engines:
                    for virtual in _virtual_stages(layers, pp, shape.micro_batches):
                        yield replace(shape, virtual_stages=virtual)
                        if replicas > 1:
                            yield replace(shape, virtual_stages=virtual, sharding="distopt")
                        if replicas > 1 and virtual == 1:  # FSDP2 next to TP (and 1F1B): not interleaved
                            yield replace(shape, sharding="fsdp2")
                if "deepspeed" in request.engines and pp == 1:  # ZeRO partitions over the DP x CP ranks
                    for offload in (False, True) if request.offload else (False,):
                        for stage in ("zero1", "zero2", "zero3"):
                            if replicas > 1 or offload:  # ZeRO over one rank only saves memory by offloading
                                yield replace(shape, engine="deepspeed", sharding=stage, offload=offload)


def _virtual_stages(layers: int, pp_size: int, micro_batches: int) -> list[int]:
    """1 (1F1B), then every ``v`` the interleaved schedule can run: ``p v`` chunks dividing the layers, ``m`` a
    multiple of ``p``."""
    if pp_size == 1:
        return [1]
    chunked = [v for v in range(2, layers // pp_size + 1) if layers % (pp_size * v) == 0]
    return [1] + [v for v in chunked if check_schedule("interleaved", pp_size, micro_batches, v) is None]


def _settings(request: Request, candidate: Candidate, most_recompute: int) -> Iterator[Candidate]:
    """The candidate's SP / recompute variants, cheapest in time first, up to ``RECOMPUTE_ORDER[most_recompute]``."""
    sp_allowed = (
        candidate.tp_size > 1
        and candidate.etp_size is None  # (whole experts under SP: not modelled)
        and candidate.engine == "accelerate"
        and _rank_seq(request, candidate) % candidate.tp_size == 0
        and _sequence_parallel_rules(request.config, candidate.tp_size)
    )
    sps = (True, False) if (sp_allowed and request.every_setting) else ((True,) if sp_allowed else (False,))
    for recompute in RECOMPUTE_ORDER[: most_recompute + 1]:
        for sp in sps:
            yield replace(candidate, sequence_parallel=sp, recompute=recompute)


def plan(request: Request) -> list[Estimate]:
    """Estimates of every layout, fastest first: for each, the fastest setting that fits (or, with
    ``every_setting``, all of them); layouts that fit nowhere follow with their smallest setting.

    A bigger micro-batch is never faster in the roofline (the same FLOPs and bytes, a larger pipeline bubble)
    and needs more memory, so it is listed only while it fits with no more recomputation than the smaller one.
    """
    results: list[Estimate] = []
    most: dict[tuple, int] = {}  # layout without its micro-batch -> most recompute a smaller micro-batch needed
    for layout in layouts(request):
        key = (
            layout.tp_size,
            layout.cp_size,
            layout.pp_size,
            layout.dp_size,
            layout.ep_size,
            layout.etp_size,
            layout.virtual_stages,
            layout.engine,
            layout.sharding,
            layout.offload,
        )
        if key in most and most[key] < 0:
            continue  # a smaller micro-batch already fit nowhere
        smallest: Estimate | None = None
        for candidate in _settings(request, layout, most.get(key, len(RECOMPUTE_ORDER) - 1)):
            result = estimate(request, candidate)
            if request.every_setting:
                results.append(result)
                continue
            if result.fits:
                results.append(result)
                most[key] = RECOMPUTE_ORDER.index(candidate.recompute)
                break
            if smallest is None or result.memory.peak < smallest.memory.peak:
                smallest = result
        else:
            if smallest is not None and key not in most:
                results.append(smallest)
            most[key] = -1
    # equal times (to 4 digits) rank by memory: the same speed with more headroom
    return sorted(results, key=lambda e: (not e.fits, float(f"{e.time.total:.4g}") if e.fits else 0, e.memory.peak))
