"""What crosses a pipeline stage boundary for one micro-batch, as one flat tensor of the model's dtype.

Always the hidden states (``[b, s, h]``); for an MoE model whose loss has the router's load-balancing term, also
the :func:`~mtk.parallel.router_loss.routing_sums` of every MoE layer before the boundary (``[2E + 1]``), to which
each stage adds its own layers' and from which the last stage's loss is computed. Backward, the same layout carries
the gradients of both. One message per pass keeps the P2P order the schedules check
(:func:`~mtk.pipeline.schedules.simulate`) and TP's scatter-gather of it unchanged.

The sums travel bit for bit as fp32 (fp64 in an fp64 model) viewed as the message's dtype: a bf16 pipeline adds
its stages' counts and probabilities at the precision one process sums them in, for ``(2E + 1) · 4`` bytes more
per message.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StageMessage"]


@dataclass(frozen=True)
class StageMessage:
    """The layout of one pass's message.

    Attributes:
        hidden_size: ``h`` of the hidden states; dtype: the message's (the model's) dtype.
        router_experts: ``E`` where routing sums travel with the hidden states, else 0.
    """

    hidden_size: int
    dtype: torch.dtype
    router_experts: int = 0

    @property
    def sums_dtype(self) -> torch.dtype:
        """fp32 (what transformers sums in), or fp64 in an fp64 message: ``(2E + 1) · 4`` bytes are never a whole
        number of fp64 elements, so the fp32 values travel as fp64 there."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def _sums_numel(self) -> int:
        """Elements of the message's dtype the sums take."""
        if not self.router_experts:
            return 0
        nbytes = (2 * self.router_experts + 1) * self.sums_dtype.itemsize
        assert nbytes % self.dtype.itemsize == 0, (self.sums_dtype, self.dtype)
        return nbytes // self.dtype.itemsize

    def numel(self, rows: int, seq: int) -> int:
        """Elements of the message for a ``[rows, seq]`` micro-batch."""
        return rows * seq * self.hidden_size + self._sums_numel()

    def pack(self, hidden: torch.Tensor, sums: torch.Tensor | None) -> torch.Tensor:
        """``[b, s, h]`` hidden states (or their gradient) and ``[2E + 1]`` sums (or theirs) -> ``[numel]``."""
        flat = hidden.detach().reshape(-1).to(self.dtype)
        if not self.router_experts:
            return flat
        if sums is None:  # nothing reached them (no router before the boundary needs a gradient)
            sums = torch.zeros(2 * self.router_experts + 1, dtype=self.sums_dtype, device=hidden.device)
        bits = sums.detach().to(self.sums_dtype).contiguous().view(torch.uint8).view(self.dtype)
        return torch.cat([flat, bits])

    def unpack(self, message: torch.Tensor, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[numel]`` -> the ``[rows, seq, h]`` hidden states (a view) and the ``[2E + 1]`` sums (a copy), or
        ``None`` where none travel."""
        count = rows * seq * self.hidden_size
        hidden = message[:count].reshape(rows, seq, self.hidden_size)
        if not self.router_experts:
            return hidden, None
        sums = message[count:].clone().view(torch.uint8).view(self.sums_dtype)  # [2E + 1]
        return hidden, sums
