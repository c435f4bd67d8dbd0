"""A transformers ``ModelOutput`` with a field set or removed, as HF would have built it.

Setting a field to ``None`` on a ``ModelOutput`` only clears the attribute: the dict entry stays, and
``out["logits"]``, ``out[1]`` and ``to_tuple()`` go on reading it. Setting a field that was ``None`` appends its
entry at the end, after fields HF places behind it. Rebuilding the output from its fields keeps HF's order and
leaves out what is ``None``, as ``to_tuple()`` then expects; an entry a hook added that is no field is kept.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["rebuilt_output", "scaled_gradients"]


def rebuilt_output(output: Any, **changes: Any) -> Any:
    """``output`` with each of ``changes`` (a field name -> its value; ``None`` removes the field), rebuilt."""
    fields = {field.name for field in dataclasses.fields(output)}
    values = {**{key: value for key, value in output.items() if key in fields}, **changes}
    rebuilt = type(output)(**{key: value for key, value in values.items() if value is not None})
    for key, value in output.items():  # (an entry a hook added that is no field: kept as it was)
        if key not in fields:
            rebuilt[key] = value
    return rebuilt


class _ScaledGradient(torch.autograd.Function):
    """The same tensor forward; its gradient times ``factor`` backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def scaled_gradients(output: Any, factor: float) -> Any:
    """``output`` (a ``ModelOutput`` or a tuple) whose tensors pass ``factor`` times their gradient back.

    Every tensor the caller receives becomes a new node of the graph, so a loss built from several of them (the
    logits and a hidden state before them) scales each path once; a cache object is left as it is."""

    def scaled(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return _ScaledGradient.apply(value, factor)
        if isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value):
            return tuple(scaled(v) for v in value)
        return value

    if isinstance(output, tuple):
        return tuple(scaled(value) for value in output)
    for key, value in list(output.items()):
        output[key] = scaled(value)
    return output
