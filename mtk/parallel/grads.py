"""Gradients of replicated parameters that only saw part of the data inside a TP region.

Two cases need the TP ranks' gradients summed:

- sequence parallelism: norm weights and row-parallel biases applied to a slice of the sequence;
  Megatron sums them after backward (:func:`sync_sequence_parallel_grads`);
- a replicated parameter applied to split heads (Qwen3's per-head q/k norms): each rank only holds
  some heads. :func:`share_params_across_tp` routes the parameters through ``copy_to_tp`` in forward,
  so backward all-reduces their gradients automatically and ``loss.backward()`` alone is exact,
  without renaming the parameters in the state dict.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mtk.parallel.comm import Group, all_reduce, copy_to_tp, group_size
from mtk.parallel.parameters import param_info, set_param_info

__all__ = ["all_reduce_coalesced", "share_params_across_tp", "sync_sequence_parallel_grads"]


def sync_sequence_parallel_grads(module: nn.Module, tp_group: Group) -> None:
    """Sum, over the TP group, the grads of parameters whose :class:`ParamInfo` says ``sequence_parallel``.

    Call after backward, before clipping and the optimizer step.
    """
    if group_size(tp_group) == 1:
        return
    grads = [p.grad for p in module.parameters() if param_info(p).sequence_parallel and p.grad is not None]
    all_reduce_coalesced(grads, tp_group)


@torch.no_grad()
def all_reduce_coalesced(tensors: Sequence[torch.Tensor], group: Group, *, average: bool = False) -> None:
    """Sum (or average) ``tensors`` in place over ``group`` with one collective per dtype.

    Gradients are many small tensors; one flat buffer per dtype costs one latency instead of one per
    tensor (what DDP's buckets do, without overlapping communication with backward).
    """
    size = group_size(group)
    if size == 1 or not tensors:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        all_reduce(flat, group)
        if average:
            flat.div_(size)
        for tensor, chunk in zip(same, flat.split([t.numel() for t in same])):
            tensor.copy_(chunk.view_as(tensor))


class _SharedParamsForward:
    """Instance ``forward`` that substitutes ``copy_to_tp(param)`` for the named parameters."""

    def __init__(self, module: nn.Module, names: Sequence[str], tp_group: Group) -> None:
        self.module, self.names, self.tp_group = module, tuple(names), tp_group
        self.class_forward = type(module).forward
        self.inside = False

    def __call__(self, *args, **kwargs):
        if self.inside:  # re-entered from functional_call: run the class's own forward
            return self.class_forward(self.module, *args, **kwargs)
        params = {name: copy_to_tp(getattr(self.module, name), self.tp_group) for name in self.names}
        self.inside = True
        try:
            return torch.func.functional_call(self.module, params, args, kwargs)
        finally:
            self.inside = False


def share_params_across_tp(module: nn.Module, names: Sequence[str], tp_group: Group) -> None:
    """Make backward sum the gradients of ``module``'s parameters ``names`` over the TP group."""
    if group_size(tp_group) == 1:
        return
    for name in names:
        set_param_info(getattr(module, name), tp_shared=True)
    module.forward = _SharedParamsForward(module, names, tp_group)
