"""Measure one TP rank's model state and activations by running mtk itself on the meta device.

Formulas for activation memory (Korthikanti et al.'s ``sbh(34 + 5as/h)``) fit one architecture and one
attention kernel; a model with a gated MLP, GQA, biases, q/k norms or a fused kernel needs another. So the
planner does not guess: it builds the model from its config on the meta device (no weights, nothing
allocated), converts it with mtk's own rules inside a fake process group of ``tp`` ranks (collectives do
nothing), and runs its forward and backward counting live bytes (activations and temporaries apart from
gradients) when the forward ends and at the peak (:class:`~mtk.planner.live_memory.LiveMemory`, the counter
``mtk bench`` measures real runs with). Parameters and AdamW state are counted from the converted model's
own tensors. The live bytes around the first decoder layer's forward give what one layer keeps; the rest of
the model (embedding, final norm, head, vocab-parallel loss) holds the remainder, and a stage's depth is then
a multiplication. A two-stage pipeline of one layer each gives what the first and last stage keep.

What the meta device cannot do itself is replaced for the trace, nowhere else:
- scaled-dot-product attention runs as a fused kernel (flash / memory-efficient attention on CUDA, the
  flash kernel on CPU) saving ``q, k, v``, the output and the ``[b, a, s]`` log-sum-exp, not the decomposed
  math path whose ``[b, a, s, s]`` scores the meta device would otherwise count; except where torch itself
  takes the math path (a CPU target with attention dropout; CUDA in fp32 with grouped-query heads);
- transformers' packed-sequence detection reads the data (``.all()``): the traced batch is unpacked.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import LoraConfig
from peft.tuners.lora.layer import ParamWrapper
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from mtk.config import RunSettings
from mtk.convert import parallelize
from mtk.convert.regions import local_blocks
from mtk.errors import MtkError, UnsupportedModelError
from mtk.lora import get_peft_model
from mtk.lora.layers import ParallelLoraLinear
from mtk.models import DTYPES, auto_class_for, with_layers
from mtk.parallel.parameters import param_info
from mtk.parallel.recompute import enable_recompute
from mtk.parallel.record import hf_model, parallelized
from mtk.parallel.state import ParallelState
from mtk.planner.live_memory import LiveMemory
from mtk.rules.generic import GENERIC
from mtk.rules.registry import find_rules

__all__ = ["RankTrace", "TraceSettings", "fake_process_group", "meta_model", "trace_rank", "with_layers"]

_KINDS = ("param", "grad", "opt", "act", "temp")


@dataclass(frozen=True)
class TraceSettings:
    """What changes a TP rank's memory per layer: the layout's TP side and the training options."""

    tp_size: int
    sequence_parallel: bool = False
    recompute: str | None = None  # None, "selective" or "full"
    lora_r: int = 0  # LoRA rank on every linear mtk splits (0: full fine-tuning)
    lora_target_parameters: tuple[str, ...] = ()  # and on these tensors (an MoE's experts: factors spread with them)
    dtype: str = "fp32"  # parameters and activations (fp32, bf16)
    device: str = "cuda"  # attention kernels of: "cuda" (fused; math in fp32 with GQA), "cpu" (math under dropout)
    chunked_loss: bool = True  # the loss holds no logits (mtk's default; not under ZeRO-3, whose head cannot defer)
    ep_size: int = 1  # expert parallelism: each MoE layer keeps 1/ep of its experts' tensors
    etp_size: int | None = None  # the experts' TP size: None (the TP size) or 1 (whole experts, the tokens split)


@dataclass(frozen=True)
class Parameters:
    """A part of one rank's model: trainable parameters (elements of each, in order) and frozen elements."""

    trainable: tuple[int, ...] = ()
    frozen: int = 0
    experts: tuple[bool, ...] = ()  # per trainable parameter: an MoE layer's expert tensor (empty: none is)
    frozen_experts: int = 0  # of ``frozen``, the elements of expert tensors (LoRA's frozen experts)
    # the elements of each trainable parameter whose gradient is summed over TP in every backward (a TP-split
    # linear's replicated LoRA factor, through copy_to_tp)
    tp_summed: tuple[int, ...] = ()
    # and of those whose whole gradient ``mtk.Accelerator`` sums once per step instead (``tp_shared``: per-head q/k
    # norms, experts whole on each TP rank, the experts' LoRA factors, under EP their 1/ep; in every backward under
    # DeepSpeed: :func:`~mtk.parallel.grads.sum_tp_shared_grads_at_step`)
    tp_summed_at_step: tuple[int, ...] = ()

    def __add__(self, other: Parameters) -> Parameters:
        experts = self.expert_flags + other.expert_flags if self.experts or other.experts else ()
        return Parameters(
            self.trainable + other.trainable,
            self.frozen + other.frozen,
            experts,
            self.frozen_experts + other.frozen_experts,
            self.tp_summed + other.tp_summed,
            self.tp_summed_at_step + other.tp_summed_at_step,
        )

    def __mul__(self, count: int) -> Parameters:
        frozen_experts = self.frozen_experts * count
        return Parameters(
            self.trainable * count,
            self.frozen * count,
            self.experts * count,
            frozen_experts,
            self.tp_summed * count,
            self.tp_summed_at_step * count,
        )

    @property
    def expert_flags(self) -> tuple[bool, ...]:
        return self.experts or (False,) * len(self.trainable)

    @property
    def elements(self) -> int:
        return sum(self.trainable) + self.frozen


@dataclass(frozen=True)
class Phases:
    """Forward and backward of a one-layer rank on a ``1 x seq`` batch, as :class:`LiveMemory` saw it (bytes).

    ``before`` / ``after``: the parameters this rank keeps ahead of / behind the decoder layers in the model's
    order (embedding; final norm and head; none on a middle pipeline stage); ``layer``: one decoder layer's.
    """

    before: Parameters
    layer: Parameters
    after: Parameters
    saved: int  # activations live when the forward ends (what backward will read)
    layer_saved: int  # of those, what the first decoder layer added (its saved tensors and its output)
    peak: int  # activations + temporaries at the forward/backward peak
    grad_at_peak: int  # gradients live at that peak


@dataclass(frozen=True)
class RankTrace:
    """One TP rank of a layout, measured so that any depth, stage and micro-batch follows by arithmetic.

    ``whole``: the one-layer model on one stage; ``first`` / ``last``: the first / last stage of a two-stage
    pipeline with one layer each (the model outside the layers split as mtk's stages split it; ``None`` when
    traced for ``pp = 1`` only). Activation bytes are per sequence of ``seq`` tokens.
    """

    seq: int
    dtype: str
    whole: Phases
    first: Phases | None = None
    last: Phases | None = None

    @property
    def layer_saved(self) -> int:
        """What each decoder layer keeps for backward, per sequence."""
        return self.whole.layer_saved


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """A process group of ``world_size`` ranks in this one process, whose collectives do nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("mtk plan traces the model in a process of its own: run it outside a distributed job")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _FusedAttention(torch.autograd.Function):
    """The tensors a fused attention kernel keeps for backward: q, k, v, output, log-sum-exp."""

    @staticmethod
    def forward(ctx, query, key, value):  # [b, a, s, d], [b, kv, s, d], [b, kv, s, dv]
        out = query.new_empty((*query.shape[:-1], value.shape[-1]))  # [b, a, s, dv]
        lse = query.new_empty(query.shape[:-1], dtype=torch.float32)  # [b, a, s]
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _takes_math_path(device: str, query: torch.Tensor, dropout_p: float, enable_gqa: bool) -> bool:
    """Where torch falls back to its math path: on CPU under dropout; on CUDA in fp32 with grouped-query heads
    passed whole (flash attention takes no fp32, the memory-efficient kernel no ``enable_gqa``; transformers passes
    it when there is no mask). Seen on an H200 (docs/bench.md): one ``[b, a, s, s]`` tensor kept per layer."""
    if device == "cpu":
        return dropout_p > 0
    return enable_gqa and query.dtype == torch.float32


def _attention_for(device: str, math_path):
    """SDPA as ``device`` runs it: a fused kernel, or torch's math path where torch itself takes it."""

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        if _takes_math_path(device, query, dropout_p, bool(kwargs.get("enable_gqa", False))):
            return math_path(query, key, value, attn_mask, dropout_p, *args, **kwargs)
        return _FusedAttention.apply(query, key, value)

    return attention


@contextlib.contextmanager
def _meta_replacements(device: str) -> Iterator[None]:
    import transformers.integrations.moe as moe
    import transformers.masking_utils as masking

    saved_sdpa, saved_packed = F.scaled_dot_product_attention, masking.find_packed_sequence_indices
    saved_grouped = moe._can_use_grouped_mm
    F.scaled_dot_product_attention = _attention_for(device, saved_sdpa)
    masking.find_packed_sequence_indices = lambda *args, **kwargs: None
    # torch's grouped matmul has a meta kernel for bf16 only: other dtypes take transformers' own fallback (an op
    # with a shape function), whose tensors are those of the grouped kernel a CPU or GPU run uses
    moe._can_use_grouped_mm = lambda input, weight, offs: (
        weight.dtype == torch.bfloat16 and saved_grouped(input, weight, offs)
    )
    # PEFT (loaded where a plan has LoRA) folds a target_parameters delta into its tensor under
    # autocast(device_type=W's), which has no meta device: the same baddbmm outside autocast (the trace has none)
    peft_layer = sys.modules.get("peft.tuners.lora.layer")
    fold = getattr(peft_layer, "_LoraFactorsProxy", None)
    saved_fold = getattr(fold, "forward", None)
    if fold is not None:
        fold.forward = lambda self, W: torch.baddbmm(W, self.lhs, self.rhs, alpha=self.scaling)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = saved_sdpa
        masking.find_packed_sequence_indices = saved_packed
        moe._can_use_grouped_mm = saved_grouped
        if fold is not None:
            fold.forward = saved_fold


def meta_model(config: PretrainedConfig, settings: TraceSettings, pp_size: int, pp_rank: int) -> nn.Module:
    """The converted model of TP rank 0 of stage ``pp_rank`` on the meta device (inside a fake group)."""
    parallel = ParallelState.build(
        tp_size=settings.tp_size, pp_size=pp_size, etp_size=settings.etp_size, device=torch.device("cpu")
    )
    with torch.device("meta"):
        model = auto_class_for(config).from_config(config, dtype=DTYPES[settings.dtype])
    # the rules mtk would pick, without the parity run that HF-derived and generic rules pass at training
    # time (it needs real numbers; `mtk verify` is where the rules' exactness is checked)
    rule_set = find_rules(config, settings.tp_size) or GENERIC
    parallelize(
        model,
        parallel,
        rule_set=rule_set,
        sequence_parallel=settings.sequence_parallel,
        loss_chunk_tokens=None if settings.chunked_loss else 0,
    )
    if settings.lora_r:
        lora = LoraConfig(
            r=settings.lora_r,
            lora_alpha=2 * settings.lora_r,
            target_modules="all-linear",
            target_parameters=list(settings.lora_target_parameters) or None,
        )
        with torch.device("meta"):
            model = get_peft_model(model, lora, report=lambda line: None)  # the user's run reports its targets
    return model


def _is_causal(config: PretrainedConfig) -> bool:
    return auto_class_for(config) is AutoModelForCausalLM


def _cache_off(config: PretrainedConfig) -> dict[str, bool]:
    return {"use_cache": False} if _is_causal(config) else {}  # encoders take no use_cache


def _parameters(model, block: nn.Module | None, ep_size: int = 1) -> tuple[Parameters, Parameters, Parameters]:
    """(ahead of the layers, one layer, behind them): trainable elements per parameter, in the model's
    order (the distributed optimizer's buckets follow it), and frozen elements; an expert tensor's ``1/ep``."""
    in_block = {id(p) for p in block.parameters()} if block is not None else set()
    moe = [m for m in model.modules() if hasattr(m, "num_experts") and hasattr(m, "down_proj")]  # spread_experts'
    experts = {id(p) for m in moe for p in m.parameters(recurse=False)}
    # the LoRA factors of expert tensors: spread with their experts under EP (1/ep of them, reduced over the expert
    # replicas), their gradients summed over TP as the experts' own part
    moe_ids = {id(m) for m in moe}
    factors = {
        id(p)
        for m in model.modules()
        if isinstance(m, ParamWrapper) and id(m.get_base_layer()) in moe_ids
        for factor in (*cast(Any, m).lora_A.values(), *cast(Any, m).lora_B.values())
        for p in factor.parameters()
    }
    # a TP-split linear's replicated adapter factor (a column's A, a row's B): its gradient summed over TP in every
    # backward (the factor passes copy_to_tp in forward), as a tp_shared one's
    summed = {
        id(p)
        for m in model.modules()
        if isinstance(m, ParallelLoraLinear)
        for factor in (cast(Any, m).lora_B if m.is_row else cast(Any, m).lora_A).values()
        for p in factor.parameters()
    }
    parts: list[tuple[list[int], list[int], list[bool], list[int], list[int], list[int]]] = [
        ([], [], [], [], [], []) for _ in range(3)
    ]
    part = 0
    for param in model.parameters():
        if id(param) in in_block:
            part = 1
        elif part == 1:
            part = 2
        trainable, frozen, flags, frozen_experts, tp_summed, at_step = parts[part]
        expert = id(param) in experts or (id(param) in factors and ep_size > 1)
        numel = param.numel() // ep_size if expert else param.numel()
        if param.requires_grad:
            trainable.append(numel)
            flags.append(expert)
            if id(param) in summed:  # through copy_to_tp
                tp_summed.append(numel)
            elif param_info(param).tp_shared:  # the whole gradient
                at_step.append(numel)
        else:
            frozen.append(numel)
            frozen_experts.append(numel if expert else 0)
    before, layer, after = (
        Parameters(
            tuple(trainable),
            sum(frozen),
            tuple(flags) if any(flags) else (),
            sum(frozen_experts),
            tuple(summed),
            tuple(at_step),
        )
        for trainable, frozen, flags, frozen_experts, summed, at_step in parts
    )
    return before, layer, after


def _phases(config: PretrainedConfig, settings: TraceSettings, seq: int, pp_size: int, pp_rank: int) -> Phases:
    """Trace forward and backward of TP rank 0 of stage ``pp_rank`` on a ``1 x seq`` batch."""
    with (
        fake_process_group(settings.tp_size * pp_size, rank=pp_rank * settings.tp_size),
        _meta_replacements(settings.device),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")  # transformers' and PEFT's notes belong to a real run, not to a trace
        model = meta_model(config, settings, pp_size, pp_rank)
        hf = hf_model(model)
        record = parallelized(hf)
        assert record is not None
        blocks = local_blocks(hf, record.rule_set)
        before, layer, after = _parameters(model, blocks[0] if blocks else None, settings.ep_size)
        enable_recompute(hf, RunSettings(recompute_granularity=settings.recompute), record.rng)
        model.train()
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        ids = torch.zeros((1, seq), dtype=torch.long, device="meta")  # [b, s]
        labels = ids if _is_causal(config) else torch.zeros((1,), dtype=torch.long, device="meta")  # [b]: classes
        stage_input = torch.empty((1, seq, config.hidden_size), dtype=dtype, device="meta", requires_grad=True)
        with (live := LiveMemory(model.parameters())):  # a weight's view (its transpose) is no activation
            hooks = live.mark_gradients(model)
            around: list[int] = []
            if blocks:  # live bytes around the first layer's own forward (after mtk's SP split, before its gather)
                block, reading = blocks[0], lambda *_: around.append(live.live.get("other", 0))
                hooks += [block.register_forward_pre_hook(reading), block.register_forward_hook(reading, prepend=True)]
            if pp_rank == 0 and pp_size > 1:  # as the pipeline engine runs a stage
                out = cast(Any, hf).base_model(input_ids=ids, use_cache=False).last_hidden_state  # [b, s, h]
                grad: torch.Tensor | None = torch.empty_like(out)
            else:
                inputs = {"inputs_embeds": stage_input} if pp_rank > 0 else {"input_ids": ids}
                out, grad = model(**inputs, labels=labels, **_cache_off(config)).loss, None
            saved = live.live.get("other", 0)
            torch.autograd.backward(out, grad)
            del out, grad
        for hook in hooks:
            hook.remove()
    return Phases(
        before=before,
        layer=layer,
        after=after,
        saved=saved,
        layer_saved=around[1] - around[0] if len(around) >= 2 else 0,
        peak=live.at_peak.get("other", 0),
        grad_at_peak=live.at_peak.get("grad", 0),
    )


@functools.lru_cache(maxsize=1024)
def _cached_phases(config_class: Any, config_json: str, settings: TraceSettings, seq: int, pp_size: int, rank: int):
    config = config_class.from_dict(json.loads(config_json))
    try:
        layers = 1 if pp_size == 1 else 2  # one per stage
        return _phases(with_layers(config, layers), settings, seq, pp_size, rank)
    except MtkError:
        raise
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as err:  # data-dependent code, for one
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UnsupportedModelError(
            f"{config.model_type}: mtk plan cannot trace this model on the meta device ({first[:160]}); "
            f"measure a layout with `mtk bench --memory` instead"
        ) from None


def trace_rank(config: PretrainedConfig, settings: TraceSettings, seq: int, *, pipeline: bool = True) -> RankTrace:
    """The trace of TP rank 0 for ``settings``; with ``pipeline`` also the first and last stage of a pipeline.
    Cached per config, settings and sequence length."""
    config_class: Any = type(config)
    config_json = config.to_json_string(use_diff=False)
    whole = _cached_phases(config_class, config_json, settings, seq, 1, 0)
    if not pipeline:
        return RankTrace(seq, settings.dtype, whole)
    first, last = (_cached_phases(config_class, config_json, settings, seq, 2, rank) for rank in (0, 1))
    return RankTrace(seq, settings.dtype, whole, first, last)
