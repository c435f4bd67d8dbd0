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

__all__ = ["rebuilt_output", "zero_gradients"]


def rebuilt_output(output: Any, **changes: Any) -> Any:
    """``output`` with each of ``changes`` (a field name -> its value; ``None`` removes the field), rebuilt."""
    fields = {field.name for field in dataclasses.fields(output)}
    values = {**{key: value for key, value in output.items() if key in fields}, **changes}
    rebuilt = type(output)(**{key: value for key, value in values.items() if value is not None})
    for key, value in output.items():  # (an entry a hook added that is no field: kept as it was)
        if key not in fields:
            rebuilt[key] = value
    return rebuilt


class _NoGradient(torch.autograd.Function):
    """A copy of the tensor forward (a node of its own and no view, which the caller may change in place), a zero
    gradient backward (the backward still runs through the graph, so every hook a reduction waits for fires)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(grad)


def zero_gradients(output: Any) -> Any:
    """``output`` (a ``ModelOutput`` or a tuple) whose tensors pass back a zero gradient.

    Each tensor that needs a gradient is replaced by a copy that is a node of its own: a loss built from several
    outputs (the logits and a hidden state before them) passes nothing back on any path, an in-place change of an
    output afterwards is the copy's, and a tensor the caller also holds (``inputs_embeds``, returned as the first
    hidden state) keeps its gradient from every other use. The copies cost the outputs' memory once; this runs only
    for a context-parallel call that runs whole with gradients on a rank whose gradient is not wanted."""

    def silenced(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return _NoGradient.apply(value)
        if isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value):
            return tuple(silenced(v) for v in value)
        return value

    if isinstance(output, tuple):
        return tuple(silenced(value) for value in output)
    for key, value in list(output.items()):
        output[key] = silenced(value)
    return output
