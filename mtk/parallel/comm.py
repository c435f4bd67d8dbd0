"""Differentiable collectives over a tensor-parallel group (Megatron's ``mappings``).

Each autograd Function is one forward/backward pair of communication; the pairs are conjugate, so a
tensor-parallel block is exact in both directions (Shoeybi et al., 2019, "Megatron-LM", section 3):

=============================  ==============================  ===============================
function                       forward                         backward
=============================  ==============================  ===============================
copy_to_tp                     identity                        all-reduce
reduce_from_tp                 all-reduce                      identity
scatter_to_tp                  keep own chunk of last dim      all-gather last dim
gather_from_tp                 all-gather last dim             keep own chunk of last dim
scatter_to_sequence            keep own chunk of seq dim       all-gather seq dim
gather_from_sequence           all-gather seq dim              reduce-scatter seq dim
 (``partial_grad=False``)      all-gather seq dim              keep own chunk of seq dim
reduce_scatter_to_sequence     reduce-scatter seq dim          all-gather seq dim
=============================  ==============================  ===============================

The sequence-parallel pair (Korthikanti et al., 2022) replaces one all-reduce by a reduce-scatter
plus an all-gather of the same total volume, so activations between TP blocks are 1/tp the size.
Every function returns its input unchanged when the group has one rank: no collective is issued.
HF models are batch-first, so the sequence dimension defaults to 1 (Megatron's is 0).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "group_rank",
    "group_size",
    "copy_to_tp",
    "reduce_from_tp",
    "scatter_to_tp",
    "gather_from_tp",
    "scatter_to_sequence",
    "gather_from_sequence",
    "reduce_scatter_to_sequence",
    "all_reduce",
    "all_gather",
    "split",
]

Group = dist.ProcessGroup | None


def group_size(group: Group) -> int:
    """Ranks in ``group``; 1 when there is no process group at all (single-process runs)."""
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This process's rank inside ``group``; 0 without a process group."""
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


# ------------------------------------------------------------------ plain (non-autograd) primitives
def all_reduce(tensor: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of a contiguous tensor; returns it for chaining."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (all ranks pass the same shape)."""
    size = group_size(group)
    if size == 1:
        return tensor
    dim = dim % tensor.dim()
    # Gather into one flat buffer along dim 0 (one collective), then move the rank axis to ``dim``.
    moved = tensor.movedim(dim, 0).contiguous()  # [n_d, ...rest]
    out = torch.empty((size * moved.shape[0], *moved.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_single(out, moved, group=group)  # [size*n_d, ...rest]
    # Contiguous, once: layers that reshape their input (F.linear on [b, s, h]) would otherwise each copy
    # it, and keep their own copy for backward (three for q, k and v under sequence parallelism).
    return out.movedim(0, dim).contiguous()


def reduce_scatter(tensor: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Sum ``tensor`` over the group and keep this rank's chunk of ``dim``."""
    size = group_size(group)
    if size == 1:
        return tensor
    dim = dim % tensor.dim()
    _check_divisible(tensor, dim, size)
    moved = tensor.movedim(dim, 0).contiguous()  # [n, ...rest]
    out = torch.empty((moved.shape[0] // size, *moved.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.reduce_scatter_single(out, moved, group=group)  # [n/size, ...rest]
    return out.movedim(0, dim)


def _private_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone(memory_format=torch.contiguous_format)


def split(tensor: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's contiguous chunk of ``dim`` (no communication)."""
    size = group_size(group)
    if size == 1:
        return tensor
    _check_divisible(tensor, dim, size)
    return tensor.chunk(size, dim=dim)[group_rank(group)].contiguous()


def _check_divisible(tensor: torch.Tensor, dim: int, size: int) -> None:
    if tensor.shape[dim] % size:
        raise ValueError(
            f"cannot split dimension {dim} of size {tensor.shape[dim]} across {size} ranks; "
            f"it must be a multiple of {size} (pad the sequence or pick another tp size)"
        )


# ----------------------------------------------------------------------------- autograd Functions
class _CopyToTP(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum the input-gradient partials of every TP rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Autograd may hand the same grad tensor to several consumers: reduce a private copy.
        return all_reduce(_private_copy(grad), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: all-reduce (sum the partial outputs). Backward: identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        # Reducing in place would silently change a tensor autograd or the caller still holds.
        return all_reduce(_private_copy(x), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather the last dim."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return split(x, group, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather(grad, ctx.group, dim=-1), None


class _GatherFromTP(torch.autograd.Function):
    """Forward: all-gather the last dim. Backward: keep this rank's chunk of the last dim."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return all_gather(x, group, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return split(grad, ctx.group, dim=-1), None


class _ScatterToSequence(torch.autograd.Function):
    """Forward: keep this rank's chunk of the sequence dim. Backward: all-gather the sequence dim."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return split(x, group, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather(grad, ctx.group, dim=ctx.dim), None, None


class _GatherFromSequence(torch.autograd.Function):
    """Forward: all-gather the sequence dim. Backward: reduce-scatter the sequence dim, or (when
    ``partial_grad`` is False) keep this rank's chunk.

    In front of a column-parallel layer every rank consumed the full sequence, so each one holds a
    partial input-gradient for all positions; summing and re-splitting gives each rank the exact
    gradient of the positions it owns. Leaving the sequence-parallel region for replicated code
    (the final norm, a classifier) every rank computes the same full gradient: its chunk is exact.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int, partial_grad: bool) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.partial_grad = group, dim, partial_grad
        return all_gather(x, group, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.partial_grad:
            return reduce_scatter(grad, ctx.group, dim=ctx.dim), None, None, None
        return split(grad, ctx.group, dim=ctx.dim), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Forward: reduce-scatter the sequence dim (after a row-parallel layer). Backward: all-gather."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return reduce_scatter(x, group, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather(grad, ctx.group, dim=ctx.dim), None, None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ScatterToTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, group)


def scatter_to_sequence(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    return x if group_size(group) == 1 else _ScatterToSequence.apply(x, group, dim)


def gather_from_sequence(x: torch.Tensor, group: Group, dim: int = 1, *, partial_grad: bool = True) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherFromSequence.apply(x, group, dim, partial_grad)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceScatterToSequence.apply(x, group, dim)
