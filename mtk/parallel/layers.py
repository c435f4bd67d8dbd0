"""Tensor-parallel Linear and Embedding layers (Megatron-LM, Shoeybi et al., 2019, section 3).

Every layer receives its TP group in the constructor and keeps only this rank's shard of the
weights. Parameters carry Megatron's attributes (``tensor_model_parallel``, ``partition_dim``) so
DeepSpeed and mtk's gradient clipping count a sharded parameter's norm once across TP ranks.

Weights are stored as ``nn.Linear`` does, ``[out_features, in_features]``, so a column split is a
split of dim 0 and a row split a split of dim 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mtk.parallel.comm import (
    Group,
    all_reduce,
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    group_rank,
    group_size,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_tp,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "mark_tensor_parallel",
    "shard_rows_by_parts",
    "sync_sequence_parallel_grads",
]


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int) -> None:
    """Tag a sharded parameter the way Megatron and DeepSpeed recognise it."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = 1


def shard_rows_by_parts(full: torch.Tensor, parts: Sequence[int], tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's rows of a dim-0-fused tensor: each part is split ``tp_size`` ways on its own.

    A fused projection such as ``[q; k; v]`` must not be cut into thirds of the fused matrix: rank r
    needs its slice of q, its slice of k and its slice of v, concatenated in that order.
    """
    if sum(parts) != full.shape[0]:
        raise ValueError(f"parts {list(parts)} do not add up to the {full.shape[0]} rows of the fused tensor")
    pieces = []
    for part in full.split(list(parts), dim=0):
        pieces.append(part.chunk(tp_size, dim=0)[tp_rank])  # [part/tp, ...]
    return torch.cat(pieces, dim=0)


def _split_sizes(total: int, parts: Sequence[int] | None, tp_size: int, what: str) -> list[int]:
    parts = list(parts) if parts else [total]
    if sum(parts) != total:
        raise ValueError(f"{what}: output_sizes {parts} must add up to out_features = {total}")
    for size in parts:
        if size % tp_size:
            raise ValueError(
                f"{what}: output size {size} is not divisible by tp = {tp_size}; pick a tp size that divides it"
            )
    return parts


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A [out, in]`` split along its output rows (the columns of ``A^T``).

    Rank r computes ``Y_r = X A_r^T + b_r``, an exact slice of the output: no reduction is needed in
    forward. In backward each rank only sees its slice of dL/dY, so dL/dX is a sum of per-rank
    partials -> one all-reduce (``copy_to_tp``). With sequence parallelism, X arrives split along the
    sequence and is all-gathered instead (its backward is a reduce-scatter).

    ``output_sizes`` describes a fused projection (``[q, k, v]``, ``[gate, up]``): each part is split
    on its own so the local output is ``[q_r, k_r, v_r]``.
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
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = group_size(tp_group), group_rank(tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.output_sizes = _split_sizes(out_features, output_sizes, self.tp_size, type(self).__name__)
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.sequence_dim = sequence_dim
        out_local = out_features // self.tp_size
        self.weight = nn.Parameter(torch.empty(out_local, in_features, device=device, dtype=dtype))
        mark_tensor_parallel(self.weight, partition_dim=0)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local, device=device, dtype=dtype))
            mark_tensor_parallel(self.bias, partition_dim=0)
        else:
            self.register_parameter("bias", None)
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full ``[out, in]`` weight or ``[out]`` bias."""
        return shard_rows_by_parts(full, self.output_sizes, self.tp_rank, self.tp_size)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's init of the *full* matrix, then sliced: same model at every tp size for one seed."""
        full = torch.empty(self.out_features, self.in_features, dtype=self.weight.dtype, device=self.weight.device)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))
        self.weight.copy_(self.shard(full))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            self.bias.copy_(self.shard(torch.empty(self.out_features, device=full.device).uniform_(-bound, bound)))

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's slice of full (unsharded) weights in."""
        self.weight.copy_(self.shard(weight))
        if bias is not None:
            self.bias.copy_(self.shard(bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [b, s, in] (or [b, s/tp, in] with sequence parallelism)
        if self.sequence_parallel:
            x = gather_from_sequence(x, self.tp_group, self.sequence_dim)  # [b, s, in]
        else:
            x = copy_to_tp(x, self.tp_group)
        y = F.linear(x, self.weight, self.bias)  # [b, s, out/tp]
        if self.gather_output:
            y = gather_from_tp(y, self.tp_group)  # [b, s, out] (per-part order when fused)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} (local {self.weight.shape[0]}), "
            f"bias={self.bias is not None}, tp_rank={self.tp_rank}/{self.tp_size}, gather_output={self.gather_output}"
            + (f", output_sizes={self.output_sizes}" if len(self.output_sizes) > 1 else "")
            + (", sequence_parallel=True" if self.sequence_parallel else "")
        )


class RowParallelLinear(nn.Module):
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
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = group_size(tp_group), group_rank(tp_group)
        if in_features % self.tp_size:
            raise ValueError(
                f"{type(self).__name__}: in_features {in_features} is not divisible by tp = {self.tp_size}"
            )
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.sequence_dim = sequence_dim
        self.weight = nn.Parameter(torch.empty(out_features, in_features // self.tp_size, device=device, dtype=dtype))
        mark_tensor_parallel(self.weight, partition_dim=1)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's columns of a full ``[out, in]`` weight."""
        return full.chunk(self.tp_size, dim=1)[self.tp_rank]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        full = torch.empty(self.out_features, self.in_features, dtype=self.weight.dtype, device=self.weight.device)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))
        self.weight.copy_(self.shard(full))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            self.bias.uniform_(-bound, bound)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight.copy_(self.shard(weight))
        if bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [b, s, in/tp] (or [b, s, in] when not input_is_parallel)
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp_group)  # [b, s, in/tp]
        partial = F.linear(x, self.weight)  # [b, s, out], this rank's share of the sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(partial, self.tp_group, self.sequence_dim)  # [b, s/tp, out]
        else:
            y = reduce_from_tp(partial, self.tp_group)  # [b, s, out]
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features={self.out_features}, "
            f"bias={self.bias is not None}, tp_rank={self.tp_rank}/{self.tp_size}, "
            f"input_is_parallel={self.input_is_parallel}"
            + (", sequence_parallel=True" if self.sequence_parallel else "")
        )


class VocabParallelEmbedding(nn.Module):
    """Embedding table ``E [V, h]`` split along the vocabulary: rank r owns rows ``[start_r, end_r)``.

    Each rank looks up the tokens it owns, writes zeros for the others, and one all-reduce sums the
    per-rank results: exactly one rank contributes a non-zero row per token, so the sum is the full
    lookup. ``V`` is padded up to a multiple of ``tp * pad_to_multiple_of``; padded rows are zero, are
    never looked up by a real token id, and never leave the layer (``num_embeddings`` stays the real
    vocabulary size).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        tp_group: Group,
        pad_to_multiple_of: int = 1,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = group_size(tp_group), group_rank(tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        multiple = self.tp_size * max(pad_to_multiple_of, 1)
        self.num_embeddings_padded = -(-num_embeddings // multiple) * multiple
        self.vocab_per_rank = self.num_embeddings_padded // self.tp_size
        self.vocab_start = self.tp_rank * self.vocab_per_rank
        self.vocab_end = self.vocab_start + self.vocab_per_rank
        self.padding_idx = padding_idx
        in_range = padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end
        self.local_padding_idx = padding_idx - self.vocab_start if in_range else None
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.sequence_dim = sequence_dim
        self.weight = nn.Parameter(torch.empty(self.vocab_per_rank, embedding_dim, device=device, dtype=dtype))
        mark_tensor_parallel(self.weight, partition_dim=0)
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def pad(self, full: torch.Tensor) -> torch.Tensor:
        """Append zero rows to a ``[V, ...]`` tensor up to the padded vocabulary size."""
        extra = self.num_embeddings_padded - full.shape[0]
        if extra == 0:
            return full
        return torch.cat([full, full.new_zeros(extra, *full.shape[1:])], dim=0)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full ``[V, h]`` table (padding added first)."""
        return self.pad(full)[self.vocab_start : self.vocab_end]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        full = torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.weight.dtype, device=self.weight.device)
        nn.init.normal_(full)
        if self.padding_idx is not None:
            full[self.padding_idx].zero_()
        self.weight.copy_(self.shard(full))

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        if weight.shape[0] != self.num_embeddings:
            raise ValueError(
                f"embedding has {weight.shape[0]} rows, expected the vocabulary size {self.num_embeddings}"
            )
        self.weight.copy_(self.shard(weight))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [b, s] global token ids
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight, self.padding_idx)  # [b, s, h]
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)  # [b, s]
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)  # [b, s]
        out = F.embedding(local_ids, self.weight, self.local_padding_idx)  # [b, s, h]
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # zero rows this rank does not own
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.tp_group, self.sequence_dim)  # [b, s/tp, h]
        return reduce_from_tp(out, self.tp_group)  # [b, s, h]

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings} (padded {self.num_embeddings_padded}, local [{self.vocab_start}, "
            f"{self.vocab_end})), {self.embedding_dim}, tp_rank={self.tp_rank}/{self.tp_size}"
            + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")
        )


def sync_sequence_parallel_grads(module: nn.Module, tp_group: Group) -> None:
    """Sum, over the TP group, the grads of replicated params that only saw a slice of the sequence.

    With sequence parallelism a replicated parameter applied to sequence-split activations (norm
    weights, a row-parallel bias) receives on each rank the gradient of its own positions only; the
    true gradient is the sum. Call after backward, before clipping and the optimizer step.
    """
    if group_size(tp_group) == 1:
        return
    grads = [p.grad for p in module.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # one collective for all of them
    all_reduce(flat, tp_group)
    for grad, chunk in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(chunk.view_as(grad))
