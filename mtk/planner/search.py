"""Enumerate the layouts of a model on a cluster, estimate each, keep those that fit, fastest first.

A layout is TP x PP x DP with a micro-batch size, sequence parallelism, activation recomputation and the
optimizer's sharding (mtk's distributed optimizer under accelerate; ZeRO 1/2/3 under DeepSpeed, which runs
TP x ZeRO-DP without a pipeline). The rules mtk enforces when it runs are the rules here: TP divides the
heads (:func:`mtk.plans.check_tp_size`) and stays inside a node, PP divides the layers, DP divides the
global batch, SP needs TP > 1 and a sequence TP divides (and accelerate).

Recomputation and SP only ever add time or save memory, so for each layout the planner keeps the first
setting that fits in this order: no recompute, selective, full (SP on where it may be, since it costs no
time and saves memory); ``every_setting`` lists all of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from transformers import PretrainedConfig

from mtk.bench.predict import predict_collectives
from mtk.errors import MtkError
from mtk.parallel.layout import Layout
from mtk.pipeline.stages import stage_layer_counts
from mtk.planner.cluster import Cluster
from mtk.planner.memory import RankMemory, Training, stage_memory, stage_parameters
from mtk.planner.timing import StepTime, Traffic, collective_seconds, flops_per_token, model_size
from mtk.planner.trace import TraceSettings, trace_rank

__all__ = ["Candidate", "Estimate", "Request", "estimate", "plan"]

RECOMPUTE_ORDER = (None, "selective", "full")
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class Request:
    """What to plan for."""

    config: PretrainedConfig
    cluster: Cluster
    seq: int
    global_batch: int
    dtype: str = "bf16"
    lora_r: int = 0
    engines: tuple[str, ...] = ("accelerate", "deepspeed")
    offload: bool = False
    reserve: int = 2 * 2**30  # per GPU: CUDA context, communicator buffers, allocator slack
    tp: int | None = None
    pp: int | None = None
    device: str = "cuda"  # attention kernels of this device (``cpu`` for the validation on this machine)
    every_setting: bool = False


@dataclass(frozen=True)
class Candidate:
    """One layout and its training options."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    micro_batches: int  # per optimizer step: pipeline micro-batches, or gradient accumulation at pp = 1
    sequence_parallel: bool = False
    recompute: str | None = None
    engine: str = "accelerate"
    sharding: str = "none"
    offload: bool = False

    @property
    def label(self) -> str:
        parts = [f"tp{self.tp} pp{self.pp} dp{self.dp}", f"{self.micro_batch}x{self.micro_batches}"]
        if self.sequence_parallel:
            parts.append("sp")
        if self.recompute:
            parts.append(f"recompute={self.recompute}")
        if self.sharding != "none":
            parts.append(self.sharding + ("+offload" if self.offload else ""))
        return " ".join(parts)


@dataclass(frozen=True)
class Estimate:
    """A candidate's predicted memory (its fullest rank), traffic and step time."""

    candidate: Candidate
    memory: RankMemory
    stage: int  # the pipeline stage of the fullest rank
    traffic: Traffic
    time: StepTime
    fits: bool
    tokens_per_s: float
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)  # the fullest rank's, by kind

    def as_dict(self) -> dict:
        c = self.candidate
        return {
            "layout": {
                "tp": c.tp,
                "pp": c.pp,
                "dp": c.dp,
                "micro_batch": c.micro_batch,
                "micro_batches": c.micro_batches,
                "sequence_parallel": c.sequence_parallel,
                "recompute": c.recompute,
                "engine": c.engine,
                "sharding": c.sharding,
                "offload": c.offload,
            },
            "label": c.label,
            "fits": self.fits,
            "memory_bytes": self.memory.as_dict(),
            "fullest_stage": self.stage,
            "communication_bytes": {"tp": self.traffic.tp, "pp": self.traffic.pp, "dp": self.traffic.dp},
            "collectives": self.collectives,
            "step_s": self.time.as_dict(),
            "tokens_per_s": self.tokens_per_s,
        }


def _layers(config: PretrainedConfig) -> int:
    return getattr(config, "num_hidden_layers", None) or config.n_layer


def _activation_size(request: Request, candidate: Candidate) -> int:
    return 2 if request.dtype == "bf16" else 4


def _trace_settings(request: Request, candidate: Candidate) -> TraceSettings:
    return TraceSettings(
        tp=candidate.tp,
        sequence_parallel=candidate.sequence_parallel,
        recompute=candidate.recompute,
        lora_r=request.lora_r,
        dtype=request.dtype,
        device=request.device,
    )


def estimate(request: Request, candidate: Candidate) -> Estimate:
    """Memory of every stage (the fullest is reported), traffic and step time of one candidate."""
    from mtk.bench.runner import has_residual_dropout, sequence_parallel_elements

    config, cluster, c = request.config, request.cluster, candidate
    trace = trace_rank(config, _trace_settings(request, c), request.seq)
    training = Training(
        dtype=request.dtype,
        engine=c.engine,
        sharding=c.sharding,
        offload=c.offload,
        dp=c.dp,
        lora=request.lora_r > 0,
        ddp=c.engine == "accelerate" and c.pp == 1,
    )
    counts = stage_layer_counts(_layers(config), c.pp)
    memories = [
        stage_memory(
            trace,
            training,
            layers=counts[s],
            stage=s,
            pp=c.pp,
            micro_batch=c.micro_batch,
            micro_batches=c.micro_batches,
        )
        for s in range(c.pp)
    ]
    stage = max(range(c.pp), key=lambda s: memories[s].peak)
    memory = memories[stage]

    layout = Layout(world_size=c.tp * c.pp * c.dp, tp_size=c.tp, pp_size=c.pp)
    element = _activation_size(request, c)
    predicted = predict_collectives(
        _layers(config),
        config.hidden_size,
        c.micro_batch * c.micro_batches,
        request.seq,
        c.tp,
        pp=c.pp,
        stage=stage,
        micro_batches=c.micro_batches,
        element_size=element,
        sequence_parallel=c.sequence_parallel,
        sequence_parallel_elements=sequence_parallel_elements(config) if c.sequence_parallel else 0,
        recompute=c.recompute,
        residual_dropout=has_residual_dropout(config),
    )
    tp_group, pp_group, dp_group = (layout.groups(kind)[0] for kind in ("tp", "pp", "dp"))
    tp_kinds = ("all_reduce", "all_gather", "reduce_scatter")
    tp_bytes = sum(predicted.nbytes[k] for k in tp_kinds)
    tp_s = sum(collective_seconds(k, predicted.nbytes[k], c.tp, cluster.bandwidth(tp_group)) for k in tp_kinds)
    pp_bytes = predicted.nbytes["send"]
    pp_s = collective_seconds("send", pp_bytes, c.pp, cluster.bandwidth(pp_group[:2])) if c.pp > 1 else 0.0
    trainable = sum(stage_parameters(trace, counts[stage], stage, c.pp).trainable)
    grad_size = 2 if (request.dtype == "bf16" and c.engine == "deepspeed") else 4
    dp_bytes = trainable * grad_size * (1 if c.dp > 1 else 0)
    dp_s = collective_seconds("all_reduce", dp_bytes, c.dp, cluster.bandwidth(dp_group))
    if c.sharding == "zero3":
        dp_s *= 1.5  # parameters gathered for forward and again for backward (ZeRO paper)
    if c.sharding == "distopt":  # the updated weights all-gathered after the step
        dp_s += collective_seconds("all_gather", trainable * 4 // c.dp, c.dp, cluster.bandwidth(dp_group))
    traffic = Traffic(tp_bytes, pp_bytes, dp_bytes, tp_s, pp_s, dp_s)

    size = model_size(config)
    tokens = c.micro_batch * c.micro_batches * request.seq  # per replica and step
    share = max(counts) / _layers(config)
    flops = flops_per_token(size, request.seq, lora=request.lora_r > 0, recompute=c.recompute)
    compute = flops * tokens * share / c.tp / cluster.peak_flops
    stage_s = compute + tp_s
    bubble_fraction = (c.pp - 1) / c.micro_batches
    bubble = stage_s * bubble_fraction
    overlapped = c.pp == 1 and c.sharding != "distopt"  # DDP / DeepSpeed reduce during backward
    dp_exposed = max(0.0, dp_s - 2 / 3 * compute) if overlapped else dp_s
    total = stage_s + bubble + pp_s + dp_exposed
    time = StepTime(compute, tp_s, bubble, pp_s, dp_exposed, total, bubble_fraction)
    fits = memory.peak <= cluster.gpu_memory - request.reserve
    collectives = {k: {"count": predicted.counts[k], "bytes": predicted.nbytes[k]} for k in sorted(predicted.counts)}
    return Estimate(c, memory, stage, traffic, time, fits, request.global_batch * request.seq / total, collectives)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_tp_sizes(request: Request) -> list[int]:
    """TP sizes that divide the heads (mtk's own check) and a node's GPUs."""
    from mtk.plans import check_tp_size

    sizes = []
    for tp in _divisors(request.cluster.gpus_per_node):
        try:
            check_tp_size(request.config, tp)
        except MtkError:
            continue
        sizes.append(tp)
    return sizes


def _pipeline_supported(config: PretrainedConfig) -> bool:
    from mtk.plans.registry import find_plan

    plan = find_plan(config)
    return plan is not None and plan.pipeline is not None


def layouts(request: Request) -> Iterator[Candidate]:
    """Every (tp, pp, dp, micro-batch, engine, sharding) the rules allow, before SP and recompute."""
    cluster, layers = request.cluster, _layers(request.config)
    tps = [request.tp] if request.tp else valid_tp_sizes(request)
    pipeline = _pipeline_supported(request.config)
    for tp in tps:
        for pp in _divisors(cluster.gpus // tp):
            if (request.pp and pp != request.pp) or layers % pp or (pp > 1 and not pipeline):
                continue
            dp = cluster.gpus // (tp * pp)
            if request.global_batch % dp:
                continue
            replica_batch = request.global_batch // dp
            for micro_batch in MICRO_BATCH_SIZES:
                if replica_batch % micro_batch:
                    continue
                shape = dict(tp=tp, pp=pp, dp=dp, micro_batch=micro_batch, micro_batches=replica_batch // micro_batch)
                if "accelerate" in request.engines:
                    yield Candidate(**shape)
                    if dp > 1:
                        yield Candidate(**shape, sharding="distopt")
                if "deepspeed" in request.engines and pp == 1:
                    for offload in (False, True) if request.offload else (False,):
                        for stage in ("zero1", "zero2", "zero3"):
                            if dp > 1 or offload:  # ZeRO at DP = 1 only saves memory by offloading
                                yield Candidate(**shape, engine="deepspeed", sharding=stage, offload=offload)


def _settings(request: Request, candidate: Candidate) -> Iterator[Candidate]:
    """The candidate's SP / recompute variants, cheapest in time first."""
    sp_allowed = candidate.tp > 1 and candidate.engine == "accelerate" and request.seq % candidate.tp == 0
    sps = (True, False) if (sp_allowed and request.every_setting) else ((True,) if sp_allowed else (False,))
    for recompute in RECOMPUTE_ORDER:
        for sp in sps:
            yield replace(candidate, sequence_parallel=sp, recompute=recompute)


def plan(request: Request) -> list[Estimate]:
    """Estimates of every layout, fastest first; for each layout the fastest setting that fits (or, with
    ``every_setting``, all of them), and the layouts that fit nowhere with their smallest setting last."""
    results: list[Estimate] = []
    for layout in layouts(request):
        smallest: Estimate | None = None
        for candidate in _settings(request, layout):
            result = estimate(request, candidate)
            if request.every_setting:
                results.append(result)
                continue
            if result.fits:
                results.append(result)
                break
            if smallest is None or result.memory.peak < smallest.memory.peak:
                smallest = result
        else:
            if smallest is not None:
                results.append(smallest)
    return sorted(results, key=lambda e: (not e.fits, e.time.total if e.fits else e.memory.peak))
