"""The language-model head after conversion: loss without gathering logits, logits gathered on demand.

HF's causal-LM classes compute their loss through ``self.loss_function`` (a settable property), so
mtk installs :class:`VocabParallelCausalLMLoss` there: HF's own forward then computes the loss from
vocab-parallel logits with two O(b*s) all-reduces. In training (labels passed, logits not asked for) the head
defers its product to that loss, which computes projection and cross-entropy chunk by chunk and never holds the
``[b, s, V/tp]`` logits (:mod:`mtk.parallel.vocab_head`, :mod:`mtk.parallel.chunked_loss`; ``loss_chunk_tokens``:
``None`` sizes the chunks, 0 turns it off).

What a caller reads as ``outputs.logits`` is never a vocabulary shard passed off as the logits. ``auto``
(the default): without labels (evaluation, generation) the full ``[..., V]`` logits, gathered with the TP
padding cut off; with labels none (``logits=None``, as Megatron returns only the loss), since gathering
them would build the full vocabulary on every rank in every training step. ``full``: always the full
logits (a caller that takes accuracy from the training forward's logits). ``shard``: the documented opt-in
to this rank's ``[..., V_padded/tp]`` columns, for code that reduces over the vocabulary itself
(:func:`gather_logits` makes them whole). :func:`logits_mode` switches a converted model for a block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mtk.parallel.chunked_loss import chunked_vocab_parallel_cross_entropy
from mtk.parallel.comm import gather_from_tp
from mtk.parallel.layers import ColumnParallelLinear
from mtk.parallel.loss import vocab_parallel_cross_entropy
from mtk.parallel.model_outputs import rebuilt_output
from mtk.parallel.vocab_head import VocabParallelHead

__all__ = [
    "LOGITS_MODES",
    "LogitsGatherHook",
    "VocabParallelCausalLMLoss",
    "attach_logits_hook",
    "gather_logits",
    "logits_mode",
    "logits_transform",
]

# Config keys of HF models that change the logits between the head and the loss: some whatever their value (Cohere's
# `logits * logit_scale`, Granite's `logits / logits_scaling`, MuseSpark's `output_multiplier`), some when set
# (Gemma's and Mistral-Large's soft cap).
_ALWAYS_APPLIED = ("logit_scale", "logits_scaling", "output_multiplier")
_APPLIED_WHEN_SET = ("final_logit_softcapping", "logit_softcapping")


def logits_transform(config: Any) -> str | None:
    """The config key by which this model changes its logits after the head (``key=value``), or ``None``; read on
    the config and on its text config (a VLM's)."""
    configs = [config]
    if hasattr(config, "get_text_config"):
        configs.append(config.get_text_config())
    for candidate in configs:
        for key in (*_ALWAYS_APPLIED, *_APPLIED_WHEN_SET):
            value = getattr(candidate, key, None)
            if value is not None:
                return f"{key}={value}"
    return None


LOGITS_MODES = ("auto", "full", "shard")


def gather_logits(local_logits: torch.Tensor, head: ColumnParallelLinear) -> torch.Tensor:
    """``[..., V_padded/tp]`` vocab-parallel logits -> ``[..., V]`` full logits (differentiable)."""
    full = gather_from_tp(local_logits, head.tp_group)  # [..., V_padded]
    return full[..., : head.out_features]


class VocabParallelCausalLMLoss:
    """Drop-in for HF's ``ForCausalLMLoss`` that takes this rank's vocabulary slice of the logits.

    Same semantics as HF: labels are shifted left by one inside (unless ``shift_labels`` is given),
    ``ignore_index`` tokens are skipped, and with ``num_items_in_batch`` the summed loss is divided
    by it (gradient accumulation over micro-batches) instead of averaging per call. When the head deferred its
    product (``logits`` is its stand-in) the loss is the chunked one, of ``chunk_tokens`` tokens per chunk
    (``None``: sized by :func:`~mtk.parallel.chunked_loss.chunk_tokens_for`).
    """

    def __init__(self, head: ColumnParallelLinear, chunk_tokens: int | None = None, model_name: str = "") -> None:
        self.head, self.chunk_tokens, self.model_name = head, chunk_tokens, model_name

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            labels = F.pad(labels, (0, 1), value=ignore_index)  # [b, s+1]
            shift_labels = labels[..., 1:]  # [b, s]: token t predicts t+1
        shift_labels = shift_labels.to(logits.device)
        reduction = "sum" if num_items_in_batch is not None else "mean"
        vocab_start = self.head.shard_spec("weight").ranges[0][0]
        head = self.head if isinstance(self.head, VocabParallelHead) else None
        hidden = head.take_deferred(logits, self.model_name) if head is not None else None
        if head is not None and hidden is not None:
            losses = chunked_vocab_parallel_cross_entropy(
                hidden,  # [b, s, H]
                head.rows(),  # [V_padded/tp, H]
                self.head.bias,
                shift_labels,
                self.head.tp_group,
                vocab_start=vocab_start,
                vocab_size=vocab_size,
                ignore_index=ignore_index,
                chunk_tokens=self.chunk_tokens,
            )  # [b, s]
            loss = losses.sum() if reduction == "sum" else losses.sum() / (shift_labels != ignore_index).sum()
        else:
            loss = vocab_parallel_cross_entropy(
                logits,  # [b, s, V_padded/tp]
                shift_labels,
                self.head.tp_group,
                vocab_start=vocab_start,
                vocab_size=vocab_size,
                ignore_index=ignore_index,
                reduction=reduction,
            )
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss


class LogitsGatherHook:
    """Forward hook on the top-level model that replaces vocab-parallel logits by what the mode says.

    ``mode``: ``auto`` gathers when no ``labels`` were passed and drops them (``None``) when labels were;
    ``full`` always gathers; ``shard`` never (the caller gets ``[..., V_padded/tp]`` and can call
    :func:`gather_logits`). :meth:`before`, the forward pre-hook, arms a :class:`VocabParallelHead` to defer its
    product to the loss when ``defer`` and the call's logits will be dropped (``auto`` with labels).
    """

    def __init__(self, head: ColumnParallelLinear, mode: str = "auto", defer: bool = False) -> None:
        if mode not in LOGITS_MODES:
            raise ValueError(f"logits mode must be one of {LOGITS_MODES}, got {mode!r}")
        self.head, self.mode, self.defer = head, mode, defer

    def before(self, module, args, kwargs) -> None:
        if isinstance(self.head, VocabParallelHead):
            dropped = self.mode == "auto" and kwargs.get("labels") is not None and not kwargs.get("fused_lm_head")
            self.head.arm(self.defer and dropped and self.head.can_defer())

    def __call__(self, module, args, kwargs, output):
        if isinstance(self.head, VocabParallelHead):
            self.head.arm(False)  # whatever the call did with it
        has_labels = kwargs.get("labels") is not None
        if self.mode == "shard":
            return None
        if isinstance(output, tuple):  # return_dict=False: (loss, logits, ...) or (logits, ...)
            index = 1 if has_labels else 0
            if self.mode == "auto" and has_labels:
                return output[:index] + output[index + 1 :]  # as HF's tuples drop what is None
            return output[:index] + (gather_logits(output[index], self.head),) + output[index + 1 :]
        if getattr(output, "logits", None) is not None:
            if self.mode == "auto" and has_labels:
                return rebuilt_output(output, logits=None)  # (the entry too, as HF builds it)
            else:
                output.logits = gather_logits(output.logits, self.head)
        return output


_HOOK = "_mtk_logits_hook"  # the converted model's LogitsGatherHook, for logits_mode


def attach_logits_hook(model: nn.Module, hook: LogitsGatherHook) -> None:
    """Register ``hook`` on ``model`` and remember it (:func:`logits_mode` finds it there)."""
    model.register_forward_pre_hook(hook.before, with_kwargs=True)
    model.register_forward_hook(hook, with_kwargs=True)
    setattr(model, _HOOK, hook)


@contextmanager
def logits_mode(model: nn.Module, mode: str) -> Iterator[None]:
    """``model``'s logits mode (``auto``, ``full`` or ``shard``) for the block; nothing to do for a model
    whose head is not vocab-parallel (its logits are whole already)."""
    if mode not in LOGITS_MODES:
        raise ValueError(f"logits mode must be one of {LOGITS_MODES}, got {mode!r}")
    hook = next((getattr(m, _HOOK) for m in model.modules() if hasattr(m, _HOOK)), None)
    if hook is None:
        yield
        return
    saved, hook.mode = hook.mode, mode
    try:
        yield
    finally:
        hook.mode = saved
