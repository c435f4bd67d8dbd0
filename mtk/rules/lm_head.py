"""The language-model head after conversion: loss without gathering logits, logits gathered on demand.

HF's causal-LM classes compute their loss through ``self.loss_function`` (a settable property), so
mtk installs :class:`VocabParallelCausalLMLoss` there: HF's own forward then computes the loss from
vocab-parallel logits with two O(b*s) all-reduces. The logits a caller *sees* are gathered (and the
TP padding cut off) only when asked: by default when no labels are passed (evaluation, generation).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mtk.parallel.comm import gather_from_tp
from mtk.parallel.layers import ColumnParallelLinear
from mtk.parallel.loss import vocab_parallel_cross_entropy

__all__ = ["LOGITS_MODES", "LogitsGatherHook", "VocabParallelCausalLMLoss", "gather_logits"]

LOGITS_MODES = ("auto", "full", "shard")


def gather_logits(local_logits: torch.Tensor, head: ColumnParallelLinear) -> torch.Tensor:
    """``[..., V_padded/tp]`` vocab-parallel logits -> ``[..., V]`` full logits (differentiable)."""
    full = gather_from_tp(local_logits, head.tp_group)  # [..., V_padded]
    return full[..., : head.out_features]


class VocabParallelCausalLMLoss:
    """Drop-in for HF's ``ForCausalLMLoss`` that takes this rank's vocabulary slice of the logits.

    Same semantics as HF: labels are shifted left by one inside (unless ``shift_labels`` is given),
    ``ignore_index`` tokens are skipped, and with ``num_items_in_batch`` the summed loss is divided
    by it (gradient accumulation over micro-batches) instead of averaging per call.
    """

    def __init__(self, head: ColumnParallelLinear) -> None:
        self.head = head

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
        loss = vocab_parallel_cross_entropy(
            logits,  # [b, s, V_padded/tp]
            shift_labels,
            self.head.tp_group,
            vocab_start=self.head.shard_spec("weight").ranges[0][0],
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
    """Forward hook on the top-level model that replaces vocab-parallel logits by full logits.

    ``mode``: ``auto`` gathers when no ``labels`` were passed; ``full`` always; ``shard`` never (the
    caller gets ``[..., V_padded/tp]`` and can call :func:`gather_logits`).
    """

    def __init__(self, head: ColumnParallelLinear, mode: str = "auto") -> None:
        if mode not in LOGITS_MODES:
            raise ValueError(f"logits mode must be one of {LOGITS_MODES}, got {mode!r}")
        self.head, self.mode = head, mode

    def __call__(self, module, args, kwargs, output):
        has_labels = kwargs.get("labels") is not None
        if self.mode == "shard" or (self.mode == "auto" and has_labels):
            return None
        if isinstance(output, tuple):  # return_dict=False: (loss, logits, ...) or (logits, ...)
            index = 1 if has_labels else 0
            return output[:index] + (gather_logits(output[index], self.head),) + output[index + 1 :]
        if getattr(output, "logits", None) is not None:
            output.logits = gather_logits(output.logits, self.head)
        return output
