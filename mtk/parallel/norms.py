"""RMSNorm over a dimension split across TP ranks (OLMo2's q/k norms over the whole q/k projection).

``y = w * x / sqrt(mean(x^2) + eps)`` where the mean runs over the *full* projection while each rank holds
only its columns ``x_r``: the sum of squares is all-reduced (``sum_r |x_r|^2``, one ``[b, s, 1]`` all-reduce)
and each rank normalizes its own columns with its slice of ``w``. Every rank uses the summed value, so its
gradient is summed over TP in backward too (``copy_to_tp`` then ``reduce_from_tp``: all-reduce both ways).
This keeps the heads split through attention, where HF's tp plan gathers the projection for the norm.
"""

from __future__ import annotations

import torch
from torch import nn

from mtk.parallel.comm import Group, copy_to_tp, reduce_from_tp
from mtk.parallel.layers import ShardedModule
from mtk.parallel.parameters import mark_tensor_parallel
from mtk.parallel.sharding import ShardSpec

__all__ = ["SplitRMSNorm"]


class SplitRMSNorm(ShardedModule):
    """An RMSNorm of width ``hidden_size`` whose input and weight are this rank's contiguous ``1/tp`` slice."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        *,
        tp_group: Group,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(tp_group)
        self.hidden_size, self.variance_epsilon = hidden_size, eps
        self.local = self.per_rank(hidden_size, "width")
        self.weight = nn.Parameter(torch.ones(self.local, device=device, dtype=dtype))
        mark_tensor_parallel(self.weight, partition_dim=0)

    def shard_spec(self, name: str) -> ShardSpec:
        start = self.tp_rank * self.local
        return ShardSpec(dim=0, ranges=((start, start + self.local),))

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.hidden_size,)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)  # [b, s, D/tp], as HF's RMSNorm computes
        squares = copy_to_tp(x.pow(2).sum(-1, keepdim=True), self.tp_group)  # [b, s, 1], this rank's share
        variance = reduce_from_tp(squares, self.tp_group) / self.hidden_size  # [b, s, 1], the full mean
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * x).to(input_dtype)

    def extra_repr(self) -> str:
        where = f"tp_rank={self.tp_rank}/{self.tp_size}"
        return f"{self.hidden_size} (local {self.local}), eps={self.variance_epsilon}, {where}"
