"""Megatron's asynchronous TP all-reduce: a column-parallel input's gradient is all-reduced while the
weight gradients of the layers it feeds are computed.

Autograd computes a linear layer's input and weight gradients in one node, and only then the
``copy_to_tp`` node all-reduces the summed input gradient, so the all-reduce waits for every weight
gradient and the matmuls wait for the all-reduce. Here the column layers' linear (:func:`column_linear`)
computes only the input gradient and leaves its weight gradient's inputs with the :class:`WeightGradients`
of the entered input; the entry (:func:`enter_overlapped`, ``copy_to_tp`` with the weights as extra
inputs) starts the all-reduce asynchronously, computes the weight gradients, then waits. The weight
gradients leave the entry's node as ordinary autograd gradients of the parameters, so accumulation,
DDP's and mtk's gradient hooks and ZeRO see them as before. One all-reduce per entered input, as
before: sibling columns sharing an input (q, k, v; gate, up) still share it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mtk.parallel.comm import Group, copy_to_tp, group_size

__all__ = ["WeightGradients", "column_linear", "enter_overlapped", "weight_gradients_of"]

_ATTRIBUTE = "_mtk_weight_gradients"


class WeightGradients:
    """What the weight gradients of one entered input's columns need, left by their backward."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        self.expected = {id(w) for w in weights}  # the entry computes these weights' gradients, no others
        self._pending: dict[int, list[tuple[torch.Tensor, torch.Tensor, bool]]] = {}  # id(weight) -> (x, g, t)

    def leave(self, key: int, x: torch.Tensor, grad: torch.Tensor, transposed: bool) -> None:
        """``key``: ``id`` of the weight as the forward got it (a saved tensor may come back as another object)."""
        self._pending.setdefault(key, []).append((x, grad, transposed))

    def compute(self, weight: torch.Tensor) -> torch.Tensor | None:
        """``dL/dW`` of ``weight`` from what its backward left (summed over its uses), or ``None``."""
        total = None
        for x, grad, transposed in self._pending.pop(id(weight), []):
            x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])  # [tokens, in], [tokens, out]
            part = x2.t().mm(g2) if transposed else g2.t().mm(x2)  # [in, out] (Conv1D) or [out, in]
            total = part if total is None else total + part
        return None if total is None else total.to(weight.dtype)  # under autocast: the low-precision product


class _EnterOverlapped(torch.autograd.Function):
    """Forward: identity. Backward: start the all-reduce of the input gradient, compute the columns'
    weight gradients, wait."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, gradients: WeightGradients, *weights: torch.Tensor):
        ctx.group, ctx.gradients, ctx.weights = group, gradients, weights
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd may share it with other consumers
        work = dist.all_reduce(grad, group=ctx.group, async_op=True)
        weight_grads = [ctx.gradients.compute(weight) for weight in ctx.weights]  # overlapping the all-reduce
        ctx.weights = ()
        if work is not None:
            work.wait()
        return (grad, None, None, *weight_grads)


class _ColumnLinear(torch.autograd.Function):
    """``F.linear`` whose backward returns the input and bias gradients and leaves the weight's."""

    @staticmethod
    def forward(ctx, x, weight, bias, transposed: bool, gradients: WeightGradients):
        ctx.key = id(weight)  # the parameter itself; activation recompute may unpack a new alias of it
        device = x.device.type
        autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)  # (not on meta)
        if autocast:  # as autocast runs F.linear: every operand in its dtype, saved so for backward
            dtype = torch.get_autocast_dtype(device)
            x, weight, bias = x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
        ctx.save_for_backward(x, weight)
        ctx.transposed, ctx.gradients, ctx.has_bias = transposed, gradients, bias is not None
        with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
            return F.linear(x, weight.t() if transposed else weight, bias)  # [b, s, out/tp]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight.t() if ctx.transposed else weight) if ctx.needs_input_grad[0] else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if ctx.needs_input_grad[1]:
            ctx.gradients.leave(ctx.key, x, grad, ctx.transposed)
        return grad_x, None, grad_bias, None, None


def enter_overlapped(x: torch.Tensor, group: Group, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``x`` into the TP region for column layers whose ``weights`` (those needing gradients) it feeds:
    identity forward; backward all-reduces dL/dX while their weight gradients are computed.

    A parameter DeepSpeed's ZeRO-3 partitions (``ds_id``) is whole only while its own module runs (DeepSpeed's
    hooks gather it there and release it after): its gradient comes from its own node, not overlapped here."""
    weights = [w for w in weights if w.requires_grad and not hasattr(w, "ds_id")]
    if group_size(group) == 1 or not weights or not torch.is_grad_enabled():
        return copy_to_tp(x, group)
    gradients = WeightGradients(weights)
    entered = _EnterOverlapped.apply(x, group, gradients, *weights)
    setattr(entered, _ATTRIBUTE, gradients)
    return entered


def weight_gradients_of(x: torch.Tensor) -> WeightGradients | None:
    """The :class:`WeightGradients` of an input :func:`enter_overlapped` returned, else ``None``."""
    return getattr(x, _ATTRIBUTE, None)


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> Any:
    """A column layer's local product: ``[b, s, in] -> [b, s, out/tp]``, its weight gradient deferred to the
    entry when ``x`` came from :func:`enter_overlapped` for this weight."""
    gradients = weight_gradients_of(x)
    if gradients is None or id(weight) not in gradients.expected or not torch.is_grad_enabled():
        return F.linear(x, weight.t() if transposed else weight, bias)
    return _ColumnLinear.apply(x, weight, bias, transposed, gradients)
