"""Tensor-parallel linear layers (Megatron-LM, Shoeybi et al., 2019, section 3).

Every layer receives its TP group in the constructor and keeps only this rank's shard of the
weights, described by a :class:`~mtk.parallel.sharding.ShardSpec` per parameter (the same spec cuts
a shard from a full tensor, reads it lazily from safetensors, and puts shards back together for
export). Parameters carry Megatron's attributes (``tensor_model_parallel``, ``partition_dim``) so
DeepSpeed and mtk's gradient clipping know a sharded parameter's norm is split across TP ranks.

Weights are stored as ``nn.Linear`` does, ``[out, in]``, or with ``transposed=True`` as HF's
``Conv1D`` does, ``[in, out]`` (GPT-2): the layout of the HF checkpoint is kept, so state-dict names
and orientations stay HF's.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from mtk.parallel.async_tp import column_linear, enter_overlapped
from mtk.parallel.comm import (
    Group,
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    group_rank,
    group_size,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_tp,
)
from mtk.parallel.parameters import mark_tensor_parallel, set_param_info
from mtk.parallel.sharding import REPLICATED, ShardSpec, take_shard

__all__ = [
    "ColumnParallelLinear",
    "KVReplicatedColumnLinear",
    "RowParallelLinear",
    "ShardedModule",
]


class ShardedModule(nn.Module, abc.ABC):
    """A module whose parameters are shards of full tensors described by :meth:`shard_spec`.

    It receives its TP group in the constructor (``tp_size``, ``tp_rank`` read from it once); sequence
    parallelism is on only when the group has more than one rank.
    """

    def __init__(self, tp_group: Group, *, sequence_parallel: bool = False, sequence_dim: int = 1) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = group_size(tp_group), group_rank(tp_group)
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.sequence_dim = sequence_dim

    def per_rank(self, size: int, what: str) -> int:
        """``size / tp``, or a one-line error naming ``what`` when tp does not divide ``size``."""
        if size % self.tp_size:
            raise ValueError(f"{type(self).__name__}: {what} {size} is not divisible by tp = {self.tp_size}")
        return size // self.tp_size

    @abc.abstractmethod
    def shard_spec(self, name: str) -> ShardSpec:
        """This rank's piece of the full tensor behind parameter ``name``."""

    @abc.abstractmethod
    def full_shape(self, name: str) -> tuple[int, ...]:
        """Shape of the full (unsharded, unpadded) tensor behind parameter ``name``."""

    def shard(self, full: torch.Tensor, name: str = "weight") -> torch.Tensor:
        """This rank's piece of the full tensor ``name`` (padding added where the spec asks)."""
        if tuple(full.shape) != self.full_shape(name):
            raise ValueError(
                f"{type(self).__name__}.{name}: full tensor has shape {tuple(full.shape)}, "
                f"expected {self.full_shape(name)}"
            )
        return take_shard(self.shard_spec(name), tuple(full.shape), full.__getitem__)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's slice of full (unsharded) tensors in."""
        cast(torch.Tensor, self.weight).copy_(self.shard(weight, "weight"))
        if bias is not None:
            cast(torch.Tensor, self.bias).copy_(self.shard(bias, "bias"))


class ColumnParallelLinear(ShardedModule):
    """``Y = X A^T + b`` with ``A [out, in]`` split along its output rows (the columns of ``A^T``).

    Rank r computes ``Y_r = X A_r^T + b_r``, an exact slice of the output: no reduction is needed in
    forward. In backward each rank only sees its slice of dL/dY, so dL/dX is a sum of per-rank
    partials -> one all-reduce (``copy_to_tp``). ``copy_input=False`` when the caller already copied X
    to the TP region for several columns at once (HF's separate q/k/v: one all-reduce, as a fused QKV;
    see :class:`~mtk.rules.base.SharedInput`). With sequence parallelism, X arrives split along the
    sequence and is all-gathered instead (its backward is a reduce-scatter).

    ``output_sizes`` describes a fused projection (``[q, k, v]``, ``[gate, up]``): each part is split
    on its own so the local output is ``[q_r, k_r, v_r]``. ``pad_to_multiple_of`` pads the output
    dimension (a vocabulary head) to a multiple of ``tp * pad_to_multiple_of`` with zero rows.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        tp_group: Group,
        gather_output: bool = False,
        output_sizes: Sequence[int] | None = None,
        pad_to_multiple_of: int | None = None,
        transposed: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        copy_input: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(tp_group, sequence_parallel=sequence_parallel, sequence_dim=sequence_dim)
        self.copy_input = copy_input
        self.in_features, self.out_features = in_features, out_features
        self.output_sizes = list(output_sizes) if output_sizes else [out_features]
        self.pad_to_multiple_of = pad_to_multiple_of
        self.gather_output, self.transposed = gather_output, transposed
        self._ranges, self.out_local = self._local_rows()
        shape = (in_features, self.out_local) if transposed else (self.out_local, in_features)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        mark_tensor_parallel(self.weight, partition_dim=1 if transposed else 0)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_local, device=device, dtype=dtype))
            mark_tensor_parallel(self.bias, partition_dim=0)
        else:
            self.register_parameter("bias", None)
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def _local_rows(self) -> tuple[tuple[tuple[int, int], ...], int]:
        """Ranges of the full output rows this rank computes, and the local (padded) row count."""
        name = type(self).__name__
        if sum(self.output_sizes) != self.out_features:
            raise ValueError(f"{name}: output_sizes {self.output_sizes} must add up to {self.out_features}")
        if self.pad_to_multiple_of:
            if len(self.output_sizes) > 1:
                raise ValueError(f"{name}: padding applies to a single (vocabulary) output, not fused parts")
            multiple = self.tp_size * self.pad_to_multiple_of
            per_rank = -(-self.out_features // multiple) * multiple // self.tp_size
            start = self.tp_rank * per_rank
            stop = min(start + per_rank, self.out_features)
            return ((start, max(start, stop)),), per_rank
        ranges, offset = [], 0
        for size in self.output_sizes:
            per_rank = self.per_rank(size, "output size")
            ranges.append((offset + self.tp_rank * per_rank, offset + (self.tp_rank + 1) * per_rank))
            offset += size
        return tuple(ranges), sum(stop - start for start, stop in ranges)

    def shard_spec(self, name: str) -> ShardSpec:
        dim = 1 if (name == "weight" and self.transposed) else 0
        return ShardSpec(dim=dim, ranges=self._ranges, local_size=self.out_local)

    def full_shape(self, name: str) -> tuple[int, ...]:
        if name == "bias":
            return (self.out_features,)
        return (self.in_features, self.out_features) if self.transposed else (self.out_features, self.in_features)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's init of the *full* matrix, then sliced: same model at every tp size for one seed."""
        full = torch.empty(self.out_features, self.in_features, dtype=self.weight.dtype, device=self.weight.device)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))
        self.weight.copy_(self.shard(full.t() if self.transposed else full, "weight"))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            full_bias = torch.empty(self.out_features, device=full.device).uniform_(-bound, bound)
            self.bias.copy_(self.shard(full_bias, "bias"))

    def _weight_for_forward(self) -> torch.Tensor:
        return self.weight.t() if self.transposed else self.weight  # [out/tp, in]

    # forward = leave(local(enter(x))): a LoRA adapter (mtk.lora) adds its share between the steps, so it
    # rides on this layer's collectives instead of adding its own.
    # True: the local product leaves its weight gradient to the input's entry (mtk.parallel.async_tp), which
    # computes it while the input gradient is all-reduced.
    defers_weight_gradient = True

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """X into the TP region: [b, s, in] (or [b, s/tp, in] with sequence parallelism) -> [b, s, in]."""
        if self.sequence_parallel:
            return gather_from_sequence(x, self.tp_group, self.sequence_dim)  # [b, s, in]
        if not self.copy_input:
            return x
        weights = [self.weight] if self.defers_weight_gradient else []
        return enter_overlapped(x, self.tp_group, weights)  # backward: all-reduce dL/dX, overlapped

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output columns: [b, s, in] -> [b, s, out/tp]."""
        return column_linear(x, self.weight, self.bias, self.transposed)

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        """[b, s, out/tp] -> [b, s, out] when ``gather_output`` (per-part order when fused), else as is."""
        return gather_from_tp(y, self.tp_group) if self.gather_output else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.leave(self.local(self.enter(x)))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} (local {self.out_local}), "
            f"bias={self.bias is not None}, tp_rank={self.tp_rank}/{self.tp_size}, gather_output={self.gather_output}"
            + (f", output_sizes={self.output_sizes}" if len(self.output_sizes) > 1 else "")
            + (", transposed=True" if self.transposed else "")
            + (", sequence_parallel=True" if self.sequence_parallel else "")
        )


class KVReplicatedColumnLinear(ColumnParallelLinear):
    """A k or v projection when tp exceeds the number of kv heads (tp a multiple of them).

    Each rank's query heads attend to one kv head: rank r holds kv head ``r // (tp / n_kv)`` whole,
    so ``tp / n_kv`` ranks (a *kv group*) hold copies of each head. Forward is exact by construction.
    Each copy receives only the gradient of its own query heads, and the true gradient is their sum,
    so the weight passes through ``copy_to_tp`` over the kv group: identity forward, all-reduce of
    the weight gradient backward. After backward every copy holds the full, identical gradient.
    """

    def __init__(
        self,
        in_features: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool = True,
        *,
        tp_group: Group,
        kv_group: Group,
        transposed: bool = False,
        copy_input: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.num_kv_heads, self.head_dim, self.kv_group = num_kv_heads, head_dim, kv_group
        super().__init__(
            in_features,
            num_kv_heads * head_dim,
            bias,
            tp_group=tp_group,
            transposed=transposed,
            copy_input=copy_input,
            device=device,
            dtype=dtype,
        )
        for param in (self.weight, self.bias):
            if param is not None:
                set_param_info(param, tp_replicas=self.copies)
                # DeepSpeed's norm adds a tensor_model_parallel gradient on every rank (others on TP rank 0 only):
                # a head held by `copies` ranks is added once, by the first of them (mtk's norm weighs each 1/c)
                param.tensor_model_parallel = self.tp_rank % self.copies == 0  # type: ignore[attr-defined]

    def _local_rows(self) -> tuple[tuple[tuple[int, int], ...], int]:
        if self.tp_size % self.num_kv_heads:
            raise ValueError(f"tp = {self.tp_size} is not a multiple of num_key_value_heads = {self.num_kv_heads}")
        self.copies = self.tp_size // self.num_kv_heads
        head = self.tp_rank // self.copies
        return ((head * self.head_dim, (head + 1) * self.head_dim),), self.head_dim

    defers_weight_gradient = False  # its weight gradient is all-reduced over the kv group in its own node

    def local(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tp(self._weight_for_forward(), self.kv_group)  # [head_dim, in]
        bias = None if self.bias is None else copy_to_tp(self.bias, self.kv_group)
        return F.linear(x, weight, bias)  # [b, s, head_dim]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", kv_head={self.tp_rank // self.copies} (x{self.copies} copies)"


class RowParallelLinear(ShardedModule):
    """``Y = X A^T + b`` with ``A [out, in]`` split along its input columns (the rows of ``A^T``).

    With X split the same way along its last dim, ``X A^T = sum_r X_r A_r^T``: each rank computes a
    partial product and one all-reduce (``reduce_from_tp``) sums them. The bias is replicated and
    added once, after the reduce. Backward of an all-reduce-sum is the identity, so dL/dX_r is local.
    After a ColumnParallelLinear, X is already split (``input_is_parallel=True``) and the pair costs
    exactly one all-reduce forward and one backward. With sequence parallelism the all-reduce is a
    reduce-scatter along the sequence.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        tp_group: Group,
        input_is_parallel: bool = True,
        transposed: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(tp_group, sequence_parallel=sequence_parallel, sequence_dim=sequence_dim)
        self.in_features, self.out_features = in_features, out_features
        self.in_local = self.per_rank(in_features, "in_features")
        self.input_is_parallel, self.transposed = input_is_parallel, transposed
        shape = (self.in_local, out_features) if transposed else (out_features, self.in_local)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        mark_tensor_parallel(self.weight, partition_dim=0 if transposed else 1)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
            set_param_info(self.bias, sequence_parallel=self.sequence_parallel)
        else:
            self.register_parameter("bias", None)
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def shard_spec(self, name: str) -> ShardSpec:
        if name == "bias":
            return REPLICATED
        start = self.tp_rank * self.in_local
        return ShardSpec(dim=0 if self.transposed else 1, ranges=((start, start + self.in_local),))

    def full_shape(self, name: str) -> tuple[int, ...]:
        if name == "bias":
            return (self.out_features,)
        return (self.in_features, self.out_features) if self.transposed else (self.out_features, self.in_features)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        full = torch.empty(self.out_features, self.in_features, dtype=self.weight.dtype, device=self.weight.device)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))
        self.weight.copy_(self.shard(full.t() if self.transposed else full, "weight"))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            self.bias.uniform_(-bound, bound)

    # forward = leave(local(enter(x))), as ColumnParallelLinear's: a LoRA adapter adds its partial sum
    # before the reduction, so the layer's one all-reduce sums both.
    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, in/tp] as is, or [b, s, in] cut to this rank's slice when not ``input_is_parallel``."""
        return x if self.input_is_parallel else scatter_to_tp(x, self.tp_group)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the sum: [b, s, in/tp] -> [b, s, out]."""
        weight = self.weight.t() if self.transposed else self.weight  # [out, in/tp]
        return F.linear(x, weight)

    def leave(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum the shares over TP ([b, s, out], or [b, s/tp, out] with sequence parallelism), then the bias."""
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(partial, self.tp_group, self.sequence_dim)  # [b, s/tp, out]
        else:
            y = reduce_from_tp(partial, self.tp_group)  # [b, s, out]
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.leave(self.local(self.enter(x)))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.in_local}), out_features={self.out_features}, "
            f"bias={self.bias is not None}, tp_rank={self.tp_rank}/{self.tp_size}, "
            f"input_is_parallel={self.input_is_parallel}"
            + (", transposed=True" if self.transposed else "")
            + (", sequence_parallel=True" if self.sequence_parallel else "")
        )
