"""TRL's fused LM head on a vocab-parallel head: the same :class:`~trl.trainer.utils.FusedCausalLMOutput`,
computed without gathering the vocabulary.

TRL's trainers (SFT, DPO, KTO, GRPO, RLOO) call ``trl.trainer.utils.add_fused_lm_head(model, ...)``, which
replaces ``model.forward`` (an instance attribute wrapping the original) so that
``model(..., labels=..., fused_lm_head=True)`` returns per-token ``log_probs`` (and, as asked, ``entropy``,
``log_sum_sq_probs``, ``mean_logits``, ``is_top1``), ``label_mask``, ``loss`` and ``aux_loss``, computed from the
backbone's hidden states and ``lm_head.weight``. After mtk's conversion that weight is this rank's slice of the
padded vocabulary, so TRL's kernel would normalize over a shard: a different, wrong distribution on each rank.

:func:`replace_trl_fused_head` puts mtk's forward in its place, keeping every setting TRL resolved (temperature,
fp32 head, requested outputs, the config's logit scale and softcap, the original forward): the backbone runs as
in TRL, the head projects only the positions whose label is not -100 (TRL's compact path) to this rank's vocab
columns, and :func:`~mtk.parallel.vocab_stats.vocab_parallel_token_stats` reduces the statistics over TP with
O(tokens) all-reduces. Loss, masking, ``shift_labels``, ``num_items_in_batch`` and the MoE load-balancing loss
follow TRL's code line for line. :func:`~mtk.rules.apply.parallelize_with` calls it on a model TRL patched
before conversion, ``mtk.Accelerator.prepare`` on one patched after; :class:`FusedHeadGuard` refuses, in one
line, a TRL fused call that reached a vocab-parallel head some other way. A head that is not split (a plain
``nn.Linear``, or tp = 1 without padding) keeps TRL's own, bit-exact forward.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from mtk.errors import ConfigError
from mtk.parallel.layers import ColumnParallelLinear
from mtk.parallel.record import hf_model
from mtk.parallel.router_loss import load_balancing_loss
from mtk.parallel.vocab_stats import STATISTICS, vocab_parallel_token_stats

__all__ = ["FusedHeadGuard", "FusedHeadSettings", "add_vocab_parallel_fused_head", "replace_trl_fused_head"]

_MARK = "_mtk_fused_head"  # on mtk's fused forward: (its settings, the forward it falls back to)


@dataclass(frozen=True)
class FusedHeadSettings:
    """What ``trl.trainer.utils.add_fused_lm_head`` resolved, read from its closure (TRL 1.16 names)."""

    temperature: float
    cast_lm_head_to_fp32: bool
    outputs: tuple[str, ...]
    final_logit_softcapping: float | None
    logit_scale: float
    backbone_attr: str  # "base_model" (or "model" for a VLM before transformers 5)
    text_config: Any


def _is_trl_fused(fn: Any) -> bool:
    """TRL's ``_fused_forward`` (its ``functools.wraps`` copies the model's names, so look at the code)."""
    code = getattr(fn, "__code__", None)
    module = getattr(fn, "__globals__", {}).get("__name__", "")
    return code is not None and code.co_name == "_fused_forward" and module.startswith("trl.")


def _chain(forward: Any) -> Iterator[Any]:
    """``forward`` and what it wraps, outermost first (bound method -> function -> ``__wrapped__`` ...)."""
    seen: set[int] = set()
    while forward is not None and id(forward) not in seen:
        seen.add(id(forward))
        yield forward
        forward = getattr(forward, "__func__", None) or getattr(forward, "__wrapped__", None)


def fused_head_kind(forward: Any) -> str | None:
    """``"trl"`` or ``"mtk"``: whose fused head ``forward`` runs (through accelerate's wrappers); else None."""
    for fn in _chain(forward):
        if _is_trl_fused(fn):
            return "trl"
        if getattr(fn, _MARK, None) is not None:
            return "mtk"
    return None


def needs_vocab_parallel_head(head: nn.Module | None) -> bool:
    """A head whose weight is not the whole vocabulary: split over TP, or padded."""
    return isinstance(head, ColumnParallelLinear) and (head.tp_size > 1 or head.out_local != head.out_features)


def _closure(fn: Any) -> dict[str, Any]:
    """The variables a nested function closes over, by name."""
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


def _trl_settings(fn: Any) -> tuple[FusedHeadSettings, Any]:
    """TRL's settings and original forward, from the closure of its ``_fused_forward``."""
    cells = _closure(fn)
    names = [f.name for f in fields(FusedHeadSettings)] + ["original_forward"]
    missing = [n for n in names if n not in cells]
    if missing:
        raise ConfigError(
            f"this TRL's fused LM head keeps no {missing} where TRL 1.16's did; mtk cannot make it vocab-parallel "
            "(install trl 1.16, or tp = 1)"
        )
    unknown = sorted(set(cells["outputs"]) - set(STATISTICS))
    if unknown:
        raise ConfigError(
            f"TRL's fused LM head was asked for {unknown}; mtk's vocab-parallel one computes {STATISTICS}"
        )
    settings = FusedHeadSettings(**{n: cells[n] for n in names[:-1]})
    return settings, _unfused(cells["original_forward"])


def _unfused(forward: Any) -> Any:
    """The forward under any fused heads (TRL's, mtk's) stacked on it."""
    while True:
        fn = getattr(forward, "__func__", None)
        if _is_trl_fused(fn):
            forward = _closure(fn)["original_forward"]
        elif getattr(fn, _MARK, None) is not None:
            forward = getattr(fn, _MARK)[1]
        else:
            return forward


def replace_trl_fused_head(model: nn.Module) -> bool:
    """Replace a forward TRL's ``add_fused_lm_head`` installed by mtk's vocab-parallel one, with TRL's settings.

    Returns whether it did: False when TRL's is not installed, or the head is not split (TRL's is exact then).
    """
    model = hf_model(model)
    get_head = getattr(model, "get_output_embeddings", None)
    forward = model.__dict__.get("forward")  # TRL sets an instance attribute
    if forward is None or get_head is None or not needs_vocab_parallel_head(get_head()):
        return False
    if fused_head_kind(forward) != "trl":
        return False
    if not _is_trl_fused(getattr(forward, "__func__", None)):
        raise ConfigError(
            "TRL's fused LM head is wrapped by another forward (accelerate's prepare?) on a vocab-parallel head; "
            "convert or prepare the model with mtk after trl's add_fused_lm_head, before anything wraps it"
        )
    settings, original = _trl_settings(forward.__func__)
    _install(model, settings, original)
    return True


def add_vocab_parallel_fused_head(
    model: nn.Module,
    temperature: float = 1.0,
    cast_lm_head_to_fp32: bool = False,
    outputs: tuple[str, ...] = ("log_probs",),
) -> None:
    """``trl.trainer.utils.add_fused_lm_head`` (same arguments) for a model converted by mtk: TRL resolves the
    settings from the config as it always does, then :func:`replace_trl_fused_head` makes the head vocab-parallel."""
    from trl.trainer.utils import add_fused_lm_head

    model = hf_model(model)
    add_fused_lm_head(cast(Any, model), temperature, cast_lm_head_to_fp32, outputs)
    replace_trl_fused_head(model)


def _install(model: nn.Module, settings: FusedHeadSettings, original: Any) -> None:
    # TRL keeps the original signature: `generate` validates its model kwargs against it
    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if fused_lm_head:
            return _fused_forward(self, settings, args, kwargs, labels, shift_labels, num_items_in_batch)
        passed = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
        kwargs.update({name: value for name, value in passed.items() if value is not None})
        return original(*args, **kwargs)

    setattr(forward, _MARK, (settings, original))
    cast(Any, model).forward = types.MethodType(forward, model)


def _fused_forward(model, settings: FusedHeadSettings, args, kwargs, labels, shift_labels, num_items_in_batch):
    """TRL's fused branch, with the head's statistics reduced over TP (see the module docstring)."""
    from trl.trainer.utils import FusedCausalLMOutput

    # (with pp > 1 this runs on the last stage, inside mtk's pipeline, which gathers the fields of its micro-batches)
    kwargs["use_cache"] = False
    if getattr(settings.text_config, "output_router_logits", False):  # MoE: as the model's own forward
        kwargs.setdefault("output_router_logits", True)
    backbone = getattr(model, settings.backbone_attr)(*args, **kwargs)
    if shift_labels is None:
        hidden, labels = backbone.last_hidden_state[:, :-1], labels[:, 1:]  # [b, s-1, h], [b, s-1]
    else:
        hidden, labels = backbone.last_hidden_state, shift_labels  # [b, s, h], [b, s]
    head = cast(ColumnParallelLinear, model.get_output_embeddings())
    hidden, labels = hidden.to(head.weight.device), labels.to(head.weight.device)
    mask = labels != -100  # [b, s']
    logits = _local_logits(head, hidden[mask], settings.cast_lm_head_to_fp32)  # [n, V_padded/tp]
    stats = vocab_parallel_token_stats(
        logits,
        labels[mask],  # [n]
        head.tp_group,
        vocab_start=head.shard_spec("weight").ranges[0][0],
        vocab_size=head.out_features,
        outputs=settings.outputs,
        temperature=settings.temperature,
        final_logit_softcapping=settings.final_logit_softcapping,
        logit_scale=settings.logit_scale,
    )
    # masked_scatter keeps an all-masked micro-batch connected to the model (a differentiable zero), as TRL's
    log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 = (
        None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x) for x in stats
    )  # each [b, s']
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -cast(torch.Tensor, log_probs).sum() / count
    aux_loss = None
    if kwargs.get("output_router_logits"):
        aux_loss = _load_balancing_loss(model, settings.text_config, backbone.router_logits, kwargs)
        loss = loss + getattr(settings.text_config, "router_aux_loss_coef", 0.0) * aux_loss
    return FusedCausalLMOutput(
        loss=loss,
        log_probs=log_probs,
        entropy=entropy,
        log_sum_sq_probs=log_sum_sq_probs,
        mean_logits=mean_logits,
        is_top1=is_top1,
        label_mask=mask,
        aux_loss=aux_loss,
    )


def _local_logits(head: ColumnParallelLinear, hidden: torch.Tensor, fp32: bool) -> torch.Tensor:
    """``[n, h] -> [n, V_padded/tp]``: the head's module call (so ZeRO-3 and hooks see it), or with
    ``cast_lm_head_to_fp32`` TRL's fp32 projection outside autocast."""
    if head.gather_output:
        raise ConfigError("the fused LM head needs the head's logits split over TP; this rule set gathers them")
    if not fp32:
        return head(hidden)
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        raise ConfigError("cast_lm_head_to_fp32 with DeepSpeed ZeRO-3 and a vocab-parallel head is not supported")
    weight = head.weight.t() if head.transposed else head.weight  # [V_padded/tp, h]
    bias = None if head.bias is None else head.bias.float()
    with torch.autocast(hidden.device.type, enabled=False):
        return F.linear(head.enter(hidden.float()), weight.float(), bias)


def _load_balancing_loss(model, text_config, router_logits, kwargs) -> torch.Tensor:
    """TRL's MoE load-balancing loss (Mixtral's, which every MoE family uses), with TRL's version switches."""
    import transformers
    from packaging.version import Version
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    version = Version(transformers.__version__)
    if version < Version("5.0.0"):
        num_experts, top_k = model.num_experts, model.num_experts_per_tok
    elif text_config.model_type == "gpt_oss" and version < Version("5.6.0"):
        num_experts, top_k = model.num_experts, text_config.num_experts_per_tok
    else:
        num_experts, top_k = text_config.num_experts, text_config.num_experts_per_tok
    # over every CP rank's part of the rows and every pipeline stage's layers, as the model's own forward sums it
    loss = load_balancing_loss(
        load_balancing_loss_func, router_logits, num_experts, top_k, kwargs.get("attention_mask")
    )
    return cast(torch.Tensor, loss)


class FusedHeadGuard:
    """Forward pre-hook of a model with a vocab-parallel head: ``fused_lm_head=True`` reaching TRL's forward
    (patched after conversion, no ``prepare`` since) is refused in one line instead of normalizing over a shard."""

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if kwargs.get("fused_lm_head") and fused_head_kind(module.forward) == "trl":
            raise ConfigError(
                "TRL's fused LM head would compute log-probs over this rank's vocabulary shard; call "
                "mtk.rules.replace_trl_fused_head(model) after trl's add_fused_lm_head (mtk.Accelerator.prepare does)"
            )
