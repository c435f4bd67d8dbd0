"""What a converted model returns per attention head or per position between its blocks, whole on every TP rank.

transformers records ``output_attentions``' weights and ``output_hidden_states``' states from inside the model
(hooks on the attention modules and the decoder layers). Under TP each rank's attention weights are its own
heads' (``[b, h/tp, q, k]``); under sequence parallelism the states between the blocks are its own positions'
(``[b, s/tp, h]``; only the last, after the sequence is gathered again, is whole). The one-process model returns
every head and every position: they are gathered over TP here, in rank order (the rules split heads and sequence
in contiguous rank-ordered blocks). Backward keeps each rank's own slice of the gradient: what uses the gathered
values runs the same on every TP rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mtk.parallel.comm import Group, gather_from_sequence, group_size
from mtk.parallel.sequence_padding import row_inputs

__all__ = ["answer_as_asked", "attach_whole_outputs"]


class _WholeOutputs:
    """Forward hook of the converted model (before sequence parallelism's trim and context parallelism's gather,
    which see whole TP values then)."""

    def __init__(self, config: Any, group: Group, sequence_parallel: bool) -> None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.heads = getattr(text, "num_attention_heads", None)
        self.group, self.size, self.sequence_parallel = group, group_size(group), sequence_parallel

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        given = row_inputs(kwargs)
        if given is None and args and isinstance(args[0], torch.Tensor):
            given = args[0]
        length = given.shape[1] if isinstance(given, torch.Tensor) and given.dim() >= 2 else None
        if isinstance(output, tuple):  # (return_dict=False)
            return tuple(self._whole(value, length) for value in output)
        if isinstance(output, dict):  # a ModelOutput: its fields that are tuples of tensors
            for key, value in list(output.items()):
                whole = self._whole(value, length)
                if whole is not value:
                    output[key] = whole
        return output

    def _whole(self, value: Any, length: int | None) -> Any:
        """A tuple of per-layer tensors with each rank's heads or positions gathered, else ``value`` itself."""
        if not isinstance(value, tuple) or not any(isinstance(v, torch.Tensor) for v in value):
            return value
        gathered = tuple(self._gathered(v, length) for v in value)
        return value if all(g is v for g, v in zip(gathered, value)) else gathered

    def _gathered(self, value: Any, length: int | None) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if value.dim() == 4 and self.heads is not None and value.shape[1] * self.size == self.heads:
            return gather_from_sequence(value, self.group, dim=1, partial_grad=False)  # [b, h/tp, q, k] -> [b, h, ...]
        sharded = self.sequence_parallel and length is not None and value.shape[1] * self.size == length
        if value.dim() == 3 and sharded:
            return gather_from_sequence(value, self.group, dim=1, partial_grad=False)  # [b, s/tp, h] -> [b, s, h]
        return value


class _AsAsked:
    """The converted model's hooks read what a call returns by name (HF's tuples put the logits at another index
    beside an MoE's ``aux_loss``, and drop what is ``None``): every call runs with ``return_dict=True``, and the
    caller's tuple (``return_dict=False``) is made from the finished ``ModelOutput``, as HF makes it
    (``to_tuple``: what is ``None``, the logits a call with labels leaves out, is not in it). Its pre-hook runs
    first, its forward hook last (context parallelism's, attached later, pops ``return_dict`` before and makes its
    own tuple after)."""

    def __init__(self) -> None:
        self._asked: list[bool] = []  # per call in progress: whether its caller asked for a tuple

    def before(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        asked = kwargs.get("return_dict")  # (None: the config's choice)
        as_tuple = (getattr(getattr(module, "config", None), "return_dict", True) if asked is None else asked) is False
        self._asked.append(as_tuple)
        return (args, {**kwargs, "return_dict": True}) if as_tuple else None

    def after(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        if not self._asked:  # (the call failed before the pre-hook ran)
            return output
        as_tuple = self._asked.pop()
        return output.to_tuple() if as_tuple and hasattr(output, "to_tuple") else output


def answer_as_asked(model: nn.Module) -> None:
    """Run every call of the converted ``model`` with ``return_dict=True`` and give a caller that asked for a
    tuple its tuple at the end (:class:`_AsAsked`). Call after every other hook of the conversion is registered."""
    hooks = _AsAsked()
    model.register_forward_pre_hook(hooks.before, with_kwargs=True, prepend=True)
    model.register_forward_hook(hooks.after, with_kwargs=True, always_call=True)


def attach_whole_outputs(model: nn.Module, group: Group, sequence_parallel: bool) -> None:
    """Gather ``model``'s per-head attention weights (and, under sequence parallelism, its per-position states
    between the blocks) over the TP ``group`` in what each call returns."""
    hook = _WholeOutputs(getattr(model, "config", None), group, sequence_parallel)
    model.register_forward_hook(hook, with_kwargs=True)
