"""Experts whole on every TP rank, each rank running them on its share of the tokens: the experts' TP size 1
(Megatron-Core's ``expert_tensor_parallel_size=1``).

Under TP every rank of a TP group holds the same tokens when they enter an MoE layer. Splitting each expert over
TP (:mod:`mtk.parallel.experts`, the experts' TP size equal to TP) narrows every expert's matmuls by TP and
all-reduces the output; under expert parallelism each TP rank then also exchanges its own copy of every token.
Keeping the experts whole and splitting the *tokens* instead keeps each expert's matmuls whole (small experts'
grouped GEMMs lose the most when split) and sends each token through EP's all-to-alls once per TP group, not once
per TP rank. The routing (router logits, top-k, the load-balancing term) stays as it is, computed for every token
on every rank; then:

1. each TP rank keeps rows ``[start, stop)`` of the flattened tokens with their top-k ids and routing weights (the
   first ``T % tp`` ranks one row more when TP does not divide the token count);
2. runs the experts on them: the model's own experts code, or EP's exchange (:mod:`mtk.parallel.expert_parallel`);
3. the outputs are all-gathered over TP into every token's row.

Backward is the conjugate. What follows the layer is replicated (or TP-split with its own reductions), so the
gathered output's gradient is the same on every TP rank and each rank keeps its rows of it; the rows' gradients
(hidden states, routing weights) are all-gathered, so every rank holds every token's, as one process would. Each
expert's gradient is the sum over the TP ranks' tokens: its tensors are ``tp_shared``
(:func:`~mtk.parallel.grads.sum_grad_over_tp`), so the TP ranks' copies stay equal and count once, as any
replicated parameter's do. The price is memory: the experts are held whole on every TP rank (under EP, each EP
rank's share of them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mtk.parallel.comm import Group, group_rank, group_size
from mtk.parallel.experts import SPECS_ATTRIBUTE
from mtk.parallel.grads import sum_grad_over_tp
from mtk.parallel.sharding import REPLICATED

__all__ = ["TOKENS_TP_GROUP_ATTRIBUTE", "split_tokens_over_tp", "token_rows"]

TOKENS_TP_GROUP_ATTRIBUTE = "mtk_tokens_tp_group"  # the TP group an experts module splits its tokens over


def token_rows(total: int, size: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of ``total`` that rank ``rank`` of ``size`` runs: even shares, the first
    ``total % size`` ranks one more."""
    share, extra = divmod(total, size)
    start = rank * share + min(rank, extra)
    return start, start + share + (1 if rank < extra else 0)


def _gather_rows(rows: torch.Tensor, total: int, group: Group) -> torch.Tensor:
    """Every rank's rows, in rank order: ``[stop - start, ...]`` -> ``[total, ...]`` (collective). Each share is
    padded to the largest, so one all-gather of equal pieces serves uneven shares."""
    size = group_size(group)
    most = -(-total // size)
    padded = rows.new_zeros((most, *rows.shape[1:]))  # [most, ...]
    padded[: rows.shape[0]] = rows
    out = rows.new_empty((size * most, *rows.shape[1:]))  # [size * most, ...]
    dist.all_gather_single(out, padded, group=group)
    shares = [token_rows(total, size, rank) for rank in range(size)]
    return torch.cat([out[r * most : r * most + stop - start] for r, (start, stop) in enumerate(shares)])


class _TakeRows(torch.autograd.Function):
    """Forward: this rank's rows of a tensor every TP rank holds whole. Backward: all-gather the rows' gradients."""

    @staticmethod
    def forward(ctx: Any, whole: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group, ctx.total = group, whole.shape[0]
        start, stop = token_rows(whole.shape[0], group_size(group), group_rank(group))
        return whole[start:stop].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_rows(grad.contiguous(), ctx.total, ctx.group), None


class _GatherRows(torch.autograd.Function):
    """Forward: all-gather every rank's rows. Backward: this rank's rows of the (TP-replicated) gradient."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, total: int, group: Group) -> torch.Tensor:
        ctx.group, ctx.total = group, total
        return _gather_rows(rows.contiguous(), total, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        start, stop = token_rows(ctx.total, group_size(ctx.group), group_rank(ctx.group))
        return grad[start:stop].contiguous(), None, None


def _take(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    if tensor.is_floating_point():
        return _TakeRows.apply(tensor, group)
    start, stop = token_rows(tensor.shape[0], group_size(group), group_rank(group))
    return tensor[start:stop]  # the top-k ids: no gradient


class _SplitTokens:
    """Pre- and post-hook of an experts module (``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights
    [T, k])``): this rank's rows in, every row out."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self._totals: list[int] = []  # the token count of each forward in progress (recompute may nest one)

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, index, weights = (list(args) + [None] * 3)[:3]
        hidden = kwargs.pop("hidden_states", hidden)
        index = kwargs.pop("top_k_index", index)
        weights = kwargs.pop("top_k_weights", weights)
        self._totals.append(hidden.shape[0])
        return (_take(hidden, self.group), _take(index, self.group), _take(weights, self.group)), kwargs

    def after(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return _GatherRows.apply(output, self._totals.pop(), self.group)  # [T_rank, H] -> [T, H]


def split_tokens_over_tp(module: nn.Module, tp_group: Group) -> None:
    """Keep ``module``'s experts whole and run them on this TP rank's share of the tokens (module docstring). Its
    expert tensors become ``tp_shared``; a loader that replaces them gives each new tensor its own gradient hook."""
    params = dict(module.named_parameters(recurse=False))
    for param in params.values():
        sum_grad_over_tp(param, tp_group)
    # whole on every TP rank: replicated, of the shape of every expert (what checkpoints record, also once EP keeps
    # a share of them here)
    setattr(module, SPECS_ATTRIBUTE, {name: (tuple(param.shape), REPLICATED) for name, param in params.items()})
    setattr(module, TOKENS_TP_GROUP_ATTRIBUTE, tp_group)
    if group_size(tp_group) > 1:
        hooks = _SplitTokens(tp_group)
        module.register_forward_pre_hook(hooks.before, with_kwargs=True)
        module.register_forward_hook(hooks.after)
