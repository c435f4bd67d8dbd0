"""Gradients of replicated parameters that only saw part of the data inside a TP region.

Two cases need the TP ranks' gradients summed:

- sequence parallelism: norm weights and row-parallel biases applied to a slice of the sequence;
  Megatron sums them after backward (:func:`sync_sequence_parallel_grads`);
- a replicated parameter applied to split heads (Qwen3's per-head q/k norms): each rank only holds
  some heads. :func:`share_params_across_tp` marks them ``tp_shared`` and gives each a gradient hook
  that sums its gradient over TP as backward produces it (before it accumulates into ``.grad``), so
  ``loss.backward()`` alone is exact, gradient accumulation and DDP/ZeRO see the summed gradient, and
  the state dict keeps HF's names. A loader that creates new parameter objects calls
  :func:`sum_grad_over_tp` on them again (the hook belongs to the tensor).

Summing in every backward costs one collective per parameter and micro-batch. A training loop that finishes the
gradients once per step (``mtk.Accelerator``'s ``backward``: DDP, the distributed optimizer, FSDP2) moves the whole
sums there instead (:func:`sum_tp_shared_grads_at_step`): by linearity the sum of the micro-batches' sums is the sum
of their sum, so the result is the same, in one coalesced all-reduce per step (Megatron-Core's
``finalize_model_grads`` does the same for its layer-norm gradients). This is what makes the experts' TP size 1
affordable: their whole gradients are summed once per step, not once per micro-batch. DeepSpeed's ZeRO reduces
gradients inside backward, so under DeepSpeed the hooks stay.

A sum over TP, unlike DP's average, must not run twice on one gradient: a loop that calls ``backward`` again on top
of a gradient the step's sum already holds (several backward calls, each a sync, before one optimizer step) would
count the earlier micro-batches ``tp`` times. Each gradient summed once per step keeps a hook that notices this and
sums such late gradients as they arrive instead (:class:`_SummedOncePerStep`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn

from mtk.parallel.comm import Group, all_reduce, group_size
from mtk.parallel.fsdp import is_sharded, local
from mtk.parallel.parameters import param_info, set_param_info

__all__ = [
    "all_reduce_coalesced",
    "share_params_across_tp",
    "sum_grad_over_tp",
    "sum_tp_shared_grads_at_step",
    "sync_sequence_parallel_grads",
]

_SUM_HOOK = "_mtk_tp_sum_hook"  # (handle, group) of a parameter's whole-gradient sum hook: movable to the step
_ONCE = "_mtk_tp_summed_once"  # the _SummedOncePerStep hook of a parameter whose gradient is summed once per step


def sync_sequence_parallel_grads(module: nn.Module, tp_group: Group) -> None:
    """Sum, over the TP group, the grads of parameters whose :class:`ParamInfo` says ``sequence_parallel`` or
    ``tp_summed_at_step``, and of ``tp_shared`` ones FSDP2 replaced (their gradient hook stayed on the tensor it
    replaced; summing the DP-averaged pieces after backward is the same sum, by linearity). One all-reduce per dtype.

    Call once per optimizer step, after the last backward, before clipping and the optimizer step.
    """
    if group_size(tp_group) == 1:
        return
    grads = []
    for param in module.parameters():
        if param.grad is None or not _summed_after_backward(param):
            continue
        once = getattr(param, _ONCE, None)
        if once is not None:
            if once.summed:  # summed already: at an earlier sync, and what came since as it came
                continue
            once.summed = True
        grads.append(local(param.grad))
    all_reduce_coalesced(grads, tp_group)


def _summed_after_backward(param: torch.Tensor) -> bool:
    info = param_info(param)
    return info.sequence_parallel or info.tp_summed_at_step or (info.tp_shared and is_sharded(param))


def sum_tp_shared_grads_at_step(module: nn.Module, tp_group: Group) -> int:
    """Move the whole-gradient TP sums of ``module``'s ``tp_shared`` parameters over ``tp_group`` from every backward
    to once per step (module docstring), and keep each gradient summed once per step from being summed twice
    (:class:`_SummedOncePerStep`, the sequence-parallel ones' too); how many moved. The caller must then run
    :func:`sync_sequence_parallel_grads` once per step, after the last backward. Sums over another group stay in
    backward."""
    moved = 0
    for param in module.parameters():
        hook = getattr(param, _SUM_HOOK, None)
        if hook is not None and hook[1] is tp_group:
            hook[0].remove()
            delattr(param, _SUM_HOOK)
            set_param_info(param, tp_summed_at_step=True)
            moved += 1
        summed = param_info(param).tp_summed_at_step or param_info(param).sequence_parallel
        if summed and param.requires_grad and group_size(tp_group) > 1 and not hasattr(param, _ONCE):
            once = _SummedOncePerStep(param, tp_group)
            param.register_hook(once)
            setattr(param, _ONCE, once)
    return moved


class _SummedOncePerStep:
    """Tensor hook of a gradient summed over TP once per step (module docstring): a gradient arriving while
    ``.grad`` holds the step's sum already is summed here, as it arrives; one arriving while ``.grad`` is ``None``
    (``zero_grad``) starts a new step. Every TP rank runs the same backward calls and syncs, so all agree."""

    def __init__(self, param: torch.Tensor, tp_group: Group) -> None:
        self.param = weakref.ref(param)
        self.tp_group = tp_group
        self.summed = False  # whether .grad holds the TP sum

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        param = self.param()
        if param is None or param.grad is None:
            self.summed = False
        return all_reduce(grad.detach().clone(), self.tp_group) if self.summed else grad


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


class _SumOverTP:
    """Tensor hook: the incoming gradient summed over the TP group (a collective inside backward, in
    graph order, so every TP rank reaches it at the same point)."""

    def __init__(self, tp_group: Group) -> None:
        self.tp_group = tp_group

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return all_reduce(grad.detach().clone(), self.tp_group)


def sum_grad_over_tp(param: nn.Parameter, tp_group: Group) -> None:
    """Mark ``param`` ``tp_shared`` and sum each of its gradients over TP before it accumulates (the sum may move to
    once per step: :func:`sum_tp_shared_grads_at_step`).

    Call once per parameter object: a second call would sum twice.
    """
    set_param_info(param, tp_shared=True)
    if group_size(tp_group) > 1 and param.requires_grad:
        handle = param.register_hook(_SumOverTP(tp_group))
        setattr(param, _SUM_HOOK, (handle, tp_group))


def share_params_across_tp(module: nn.Module, names: Sequence[str], tp_group: Group) -> None:
    """Make backward sum the gradients of ``module``'s parameters ``names`` over the TP group."""
    for name in names:
        sum_grad_over_tp(getattr(module, name), tp_group)
