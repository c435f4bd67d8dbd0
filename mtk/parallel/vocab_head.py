"""The LM head: a column layer over the (padded) vocabulary whose product the loss may take over.

HF's causal-LM forward computes ``logits = self.lm_head(hidden)`` and hands them to ``self.loss_function``; for
training, mtk's loss (:class:`~mtk.rules.lm_head.VocabParallelCausalLMLoss`) rather computes the projection and
the cross-entropy together, chunk by chunk (:mod:`mtk.parallel.chunked_loss`), so no ``[b, s, V/tp]`` logits are
ever held. For that one call the head is *armed* (by the converted model's forward pre-hook, when labels are
passed and no caller asked for logits): its forward brings its input into the TP region as usual (the copy, or
sequence parallelism's all-gather) and returns a stand-in of the logits' shape that holds no memory, keeping the
entered input for the loss. The loss checks it got that very stand-in: a model that transforms its logits before
the loss (a soft cap, a scale) would otherwise be computed from nothing, and is refused in one line.

A head called some other way (mtk's LoRA adapter runs ``enter``/``local``/``leave`` itself, PEFT's copy of the
head in ``modules_to_save`` is another module) is not armed and computes its logits; the loss then takes them
as before. DeepSpeed ZeRO-3 holds a partitioned weight whole only while the head's own forward runs, so there
the head never defers.
"""

from __future__ import annotations

import torch

from mtk.errors import ConfigError
from mtk.parallel.layers import ColumnParallelLinear

__all__ = ["VocabParallelHead"]


class VocabParallelHead(ColumnParallelLinear):
    """:class:`ColumnParallelLinear` over the vocabulary (the ``lm_head`` style) that can defer its product."""

    _armed = False
    _deferred: tuple[torch.Tensor, torch.Tensor] | None = None  # (the stand-in returned, the entered input)

    def arm(self, armed: bool) -> None:
        """Defer (``True``) or compute (``False``) the product of this head's next forward; drops any deferral
        left by a call that failed before its loss."""
        self._armed, self._deferred = armed, None

    def can_defer(self) -> bool:
        """Whether this head can hand its product to the loss: not gathered, and its weight not DeepSpeed's."""
        return not self.gather_output and not hasattr(self.weight, "ds_id")

    def rows(self) -> torch.Tensor:
        """The weight as ``[V_padded/tp, H]`` (a Conv1D head's transposed), what the deferred product multiplies."""
        return self._weight_for_forward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._armed:
            return super().forward(x)
        self._armed = False
        entered = self.enter(x)  # [b, s, H], in the TP region
        stand_in = entered.new_empty(()).expand(*entered.shape[:-1], self.out_local)  # [b, s, V/tp], one element
        self._deferred = (stand_in, entered)
        return stand_in

    def take_deferred(self, logits: torch.Tensor, model_name: str) -> torch.Tensor | None:
        """The entered input ``[b, s, H]`` behind ``logits`` when this head deferred its product, else ``None``
        (``logits`` are real)."""
        deferred, self._deferred, self._armed = self._deferred, None, False
        if deferred is None:
            return None
        stand_in, entered = deferred
        if logits is not stand_in:
            raise ConfigError(
                f"{model_name} changes its logits between the LM head and the loss (a soft cap or a scale), which "
                "mtk's chunked loss does not apply; set loss_chunk_tokens = 0 (MTK_LOSS_CHUNK_TOKENS=0)"
            )
        return entered
