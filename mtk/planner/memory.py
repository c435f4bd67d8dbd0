"""Per-rank memory of a layout, composed from a :class:`~mtk.planner.trace.RankTrace` by arithmetic.

A rank's peak is its model state plus the larger of two moments of the step:

- **forward/backward**: the activations the stage keeps for every micro-batch in flight (1F1B: stage ``s``
  of ``p`` holds ``min(m, p - s)``; interleaved over ``v`` chunks: ``2 (p - s - 1) + (v - 1) p + 1`` chunk
  passes of ``1/v`` of the stage each, the schedule's own order counted by
  :func:`~mtk.pipeline.schedules.peak_in_flight`), plus what backward allocates on top of them for one
  micro-batch (the logits' gradient, a recomputed block), plus the gradients live then (all of them once an earlier
  micro-batch has run backward; with one micro-batch only those the trace saw at its peak);
- **gradient reduction and optimizer step**: every gradient, plus the flat copies mtk's own DP reduction
  all-reduces (a pipeline's buckets, the bench's coalesced call; DDP's buckets instead live all step) and
  the distributed optimizer's all-gather buckets.

Model state by precision and engine (``P`` trainable elements, ``F`` frozen):

=====================  ===========  ===========  ==============================
engine, dtype          weights      gradients    optimizer (AdamW)
=====================  ===========  ===========  ==============================
accelerate fp32        4 (P+F)      4 P          8 P (/ DP: distributed optimizer)
accelerate bf16        4 P + 4 F    4 P          8 P   (autocast keeps fp32 weights)
deepspeed bf16         2 (P+F)      2 P + 4 P/DP 12 P  (fp32 master + moments)
=====================  ===========  ===========  ==============================

FSDP2 (accelerate's ``parallelism_config``, :mod:`mtk.parallel.fsdp`) divides all three by DP, and holds one decoder
layer gathered (two: the next one prefetched) and one layer's unsharded gradients until they are reduce-scattered.
ZeRO-1 divides the optimizer column by DP (at EP, DeepSpeed's MoE parameter groups by the ``dp / ep`` replicas
holding the same experts), ZeRO-2 the gradients too, ZeRO-3 the weights too (ZeRO paper:
16 bytes per parameter for mixed-precision Adam, the accelerate bf16 and deepspeed bf16 rows alike).
DeepSpeed also keeps the fp32 gradients of a rank's partition for the step (``4 P / DP``): its own
``estimate_zero2_model_states_mem_needs`` counts ``2 P + 18 P / DP``, which these rows reproduce.
A LoRA base (``F``) stays in ``--dtype`` (bf16: mtk's ``--base_dtype bf16``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import cast

from mtk.models import element_size
from mtk.parallel.distributed_optimizer import assign_owners
from mtk.pipeline.schedules import peak_in_flight
from mtk.planner.trace import Parameters, Phases, RankTrace

__all__ = ["RankMemory", "Training", "stage_memory", "stage_parameters"]

GATHER_BUCKET_ELEMENTS = 2**22  # mtk.parallel.distributed_optimizer.BUCKET_ELEMENTS
REDUCE_BUCKET_BYTES = 25 * 2**20  # mtk.parallel.overlap.BUCKET_BYTES (DDP's default bucket_cap_mb)
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's reduce_bucket_size / stage3 live-parameter defaults


@dataclass(frozen=True)
class Training:
    """What the step does besides the model: precision, engine, optimizer sharding, gradient reduction."""

    dtype: str = "fp32"  # fp32 or bf16 (accelerate: autocast; deepspeed: bf16 weights, fp32 master)
    engine: str = "accelerate"  # accelerate or deepspeed
    sharding: str = "none"  # none, distopt or fsdp2 (accelerate), zero1, zero2, zero3 (deepspeed)
    offload: bool = False  # deepspeed: optimizer state (and master weights) in CPU memory
    dp_size: int = 1
    lora: bool = False  # the frozen base stays in ``dtype``; adapters train in fp32
    ddp: bool = False  # accelerate at pp = 1: DDP's buckets hold a copy of the gradients all step
    ep_size: int = 1  # expert parallelism: the experts' optimizer state is sharded over dp / ep replicas


@dataclass(frozen=True)
class RankMemory:
    """Bytes of one rank: its model state, the activations and buffers at its peak, and the peak."""

    weights: int
    gradients: int
    optimizer: int
    activations: int  # live at the forward/backward peak
    buffers: int  # communication buffers live at the peak
    peak: int  # weights + optimizer + the larger of (activations + gradients live then, gradients + reduction)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def stage_parameters(trace: RankTrace, layers: int, stage: int, pp_size: int) -> Parameters:
    """This stage's parameters in the model's order: those ahead of the layers, ``layers`` decoder layers,
    those behind them."""
    phases = _stage_phases(trace, stage, pp_size)
    if phases is None:
        return trace.whole.layer * layers
    return phases.before + trace.whole.layer * layers + phases.after


def _stage_phases(trace: RankTrace, stage: int, pp_size: int) -> Phases | None:
    if pp_size == 1:
        return trace.whole
    if trace.first is None or trace.last is None:
        raise ValueError("a pipeline stage needs a trace with pipeline=True")
    if stage == 0:
        return trace.first
    if stage == pp_size - 1:
        return trace.last
    return None  # a middle stage: layers only


def _owned(numels: tuple[int, ...], dp_size: int, dp_rank: int | None) -> int:
    """Elements whose optimizer state DP rank ``dp_rank`` keeps under mtk's distributed optimizer (``None``:
    the most loaded rank)."""
    owners = assign_owners(list(numels), dp_size)
    loads = [sum(n for n, owner in zip(numels, owners) if owner == rank) for rank in range(dp_size)]
    return max(loads) if dp_rank is None else loads[dp_rank]


def stage_memory(
    trace: RankTrace,
    training: Training,
    *,
    layers: int,
    stage: int = 0,
    pp_size: int = 1,
    micro_batch_size: int = 1,
    micro_batches: int = 1,
    virtual_stages: int = 1,
    dp_rank: int | None = None,
    attention_workspace: int = 0,
) -> RankMemory:
    """Peak bytes of a TP rank of pipeline stage ``stage`` holding ``layers`` decoder layers.

    ``micro_batch_size`` sequences of ``trace.seq`` tokens per forward; ``micro_batches`` forwards per optimizer
    step (pipeline micro-batches, or gradient accumulation at ``pp = 1``); ``virtual_stages`` > 1: the
    interleaved schedule over that many chunks per rank (1F1B otherwise). ``dp_rank``: whose share of a
    sharded optimizer (default: the largest). ``attention_workspace``: bytes per sequence an attention the trace
    did not run keeps while it computes (context parallelism's score blocks), on top of the trace's peak.
    """
    params = stage_parameters(trace, layers, stage, pp_size)
    trainable, frozen = sum(params.trainable), params.frozen
    dp = training.dp_size
    bf16_deepspeed = training.dtype == "bf16" and training.engine == "deepspeed"
    weight_size = 2 if bf16_deepspeed else 4
    base_size = element_size(training.dtype)  # a frozen LoRA base stays in --dtype
    weights = trainable * weight_size + frozen * (base_size if training.lora else weight_size)
    gradients = trainable * weight_size
    optimizer = trainable * (12 if bf16_deepspeed else 8)
    buffers = 0
    if training.sharding == "distopt" and training.ep_size > 1:  # dense state over DP, experts' over dp / ep
        flags, ep = params.expert_flags, training.ep_size
        dense = tuple(n for n, expert in zip(params.trainable, flags) if not expert)
        experts = tuple(n for n, expert in zip(params.trainable, flags) if expert)
        # an EP group is a run of ep replicas: its index is rank // ep (dp_rank None: each domain's fullest rank,
        # which may be two ranks: an upper bound)
        owned = _owned(dense, dp, dp_rank)
        owned += _owned(experts, max(dp // ep, 1), None if dp_rank is None else dp_rank // ep)
        optimizer = owned * 8
    elif training.sharding == "distopt":
        optimizer = _owned(params.trainable, dp, dp_rank) * 8
    elif training.sharding == "fsdp2":
        frozen_size = base_size if training.lora else weight_size

        def ignored(part: Parameters) -> int:
            """Trainable elements of ``part``'s experts spread over EP: FSDP2 leaves them whole (neither split nor
            gathered)."""
            return sum(n for n, e in zip(part.trainable, part.expert_flags) if e) if training.ep_size > 1 else 0

        def ignored_frozen(part: Parameters) -> int:
            """The same of its frozen experts (LoRA's)."""
            return part.frozen_experts if training.ep_size > 1 else 0

        def gathered(part: Parameters) -> int:
            trainable = sum(part.trainable) - ignored(part)
            return trainable * weight_size + (part.frozen - ignored_frozen(part)) * frozen_size

        ends = _stage_phases(trace, stage, pp_size)  # the root unit: what the stage holds outside its layers
        root = (ends.before + ends.after) if ends is not None else Parameters()
        layer = trace.whole.layer
        # the root stays gathered from its forward to its backward, a layer and the next one (prefetched) with it,
        # and the larger unit's unsharded gradients wait for their reduce-scatter
        buffers += gathered(root) + 2 * gathered(layer) + max(sum(layer.trainable), sum(root.trainable)) * 4
        whole = ignored(params)  # elements; bytes below
        whole_weights = whole * weight_size + ignored_frozen(params) * frozen_size
        weights = -(-(weights - whole_weights) // dp) + whole_weights
        gradients = -(-(gradients - whole * weight_size) // dp) + whole * weight_size
        optimizer = -(-(optimizer - whole * 8) // dp) + whole * 8
    elif training.sharding in ("zero1", "zero2", "zero3"):
        # DeepSpeed partitions the dense state over DP x CP and, at EP, its MoE parameter groups (the spread experts
        # or their LoRA factors) over the dp / ep replicas holding the same experts
        spread = (
            sum(n for n, expert in zip(params.trainable, params.expert_flags) if expert) if training.ep_size > 1 else 0
        )
        replicas = max(dp // training.ep_size, 1)

        def partitioned(per_element: int) -> int:
            return -(-(trainable - spread) * per_element // dp) + -(-spread * per_element // replicas)

        optimizer = partitioned(12 if bf16_deepspeed else 8)
        if training.sharding in ("zero2", "zero3"):
            gradients = partitioned(weight_size)
            buffers += min(trainable, DEEPSPEED_BUCKET_ELEMENTS) * weight_size  # the reduce bucket
        if training.sharding == "zero3":
            weights = -(-weights // dp)
            buffers += min(trainable + frozen, DEEPSPEED_BUCKET_ELEMENTS) * weight_size  # gathered live parameters
        if bf16_deepspeed and not training.offload:  # the fp32 gradients of this rank's partition, for the step
            gradients += partitioned(4)
    if training.offload:
        optimizer = 0

    # activations, per micro-batch in flight
    phases = _stage_phases(trace, stage, pp_size) or cast(Phases, trace.first)
    rest_saved = phases.saved - trace.layer_saved
    saved = max(rest_saved, 0) + layers * trace.layer_saved  # one sequence
    transient = phases.peak - phases.saved + attention_workspace
    v = virtual_stages
    schedule = "interleaved" if v > 1 else "1f1b"
    in_flight = peak_in_flight(schedule, micro_batches, stage, pp_size, v) if pp_size > 1 else 1  # chunk passes
    activations = micro_batch_size * (in_flight * saved // v + transient)  # a chunk pass keeps 1/v of the stage's
    trace_grad_bytes = sum(phases.before.trainable + phases.layer.trainable + phases.after.trainable)
    trace_grad_bytes *= element_size(trace.dtype)
    # Every gradient is live at the most-in-flight moment once a backward ran before it: accumulation at
    # pp = 1, a 1F1B steady state (m > p - s); else only those backward had made when the trace peaked.
    partial = int(gradients * phases.grad_at_peak / max(trace_grad_bytes, 1))
    grads_live = gradients if micro_batches * v > in_flight else partial

    reduction = 0  # the gradient reduction's own memory, live while every gradient is
    if dp > 1 and training.engine == "accelerate" and training.sharding != "fsdp2":  # FSDP2's are in buffers
        spread = (
            sum(n for n, expert in zip(params.trainable, params.expert_flags) if expert) * weight_size
            if training.ep_size > 1
            else 0
        )
        if training.ddp:
            buffers += gradients - spread  # DDP's buckets: a persistent copy (of the dense ones: DDP skips experts)
            if spread and dp > training.ep_size:  # the experts' reduction copies one bucket at a time
                largest = max((n for n, e in zip(params.trainable, params.expert_flags) if e), default=0)
                reduction = min(spread, max(REDUCE_BUCKET_BYTES, largest * weight_size))
        else:
            reduction = gradients  # the coalesced all-reduce's flat copy
        if training.sharding == "distopt":
            largest = max(params.trainable, default=0)
            reduction = max(reduction, (dp + 1) * max(GATHER_BUCKET_ELEMENTS, largest) * weight_size)
    backward = activations + grads_live
    after = gradients + reduction
    peak = weights + optimizer + buffers + max(backward, after)
    return RankMemory(weights, gradients, optimizer, activations, max(buffers, buffers + reduction), peak)
