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


def zero_gradients(output: Any) -> Any:
    """``output`` (a ``ModelOutput`` or a tuple), its tensors made to pass back a zero gradient.

    A hook on each tensor (and on the tensor it is a view of) replaces its gradient by zeros. Zero is the same
    however often it is applied, so a loss built from several outputs (the logits and a hidden state before them)
    passes nothing back on any path, and an in-place change of an output afterwards (``out.loss /= steps``, which
    rebases a view onto its base) keeps it so. The tensors themselves stay as they are (no copy)."""

    def silence(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            for tensor in (value, value._base):
                if tensor is not None and tensor.requires_grad:
                    tensor.register_hook(torch.zeros_like)
        elif isinstance(value, tuple):
            for item in value:
                silence(item)

    for value in output if isinstance(output, tuple) else output.values():
        silence(value)
    return output
