"""Tensors transformers assembles at load time from several checkpoint tensors, read slice by slice.

transformers 5 keeps some checkpoints in their original layout and converts while loading: Mixtral's experts
are stored one tensor per expert (``block_sparse_moe.experts.3.w1.weight``) and become ``mlp.experts.gate_up_proj
[E, 2I, H]`` through the model type's conversion mapping (renamings, then ``MergeModulelist(dim=0)`` and
``Concatenate``). :func:`converted_tensors` runs transformers' own renaming over the checkpoint's keys and gives,
for each model tensor built that way, a :class:`MergedSlicer`: the merged tensor's shape, and ``merged[index]``
read from the source tensors' slices only, so a rank still reads only its shard's bytes.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from mtk.errors import CheckpointError

__all__ = ["MergedSlicer", "converted_tensors"]

Slicer = Any  # a safetensors slice: get_shape() and __getitem__(tuple of slices)


def _expert_order(key: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\.(\d+)\.", key))


class MergedSlicer:
    """``cat_dim(stack_0(part_0), stack_0(part_1), ...)`` of the parts' per-expert tensors, read by slice."""

    def __init__(self, parts: list[list[Slicer]], concat_dim: int | None, sources: tuple[str, ...] = ()) -> None:
        self.parts, self.concat_dim = parts, concat_dim
        self.sources = sources  # the checkpoint keys it reads
        shapes = {tuple(s.get_shape()) for part in parts for s in part}
        experts = {len(part) for part in parts}
        if len(experts) != 1 or (concat_dim is None and len(parts) != 1):
            raise CheckpointError("a converted tensor's parts disagree in their number of experts")
        if concat_dim is None and len(shapes) != 1:
            raise CheckpointError("a converted tensor's experts have different shapes")

    def get_shape(self) -> tuple[int, ...]:
        first = list(self.parts[0][0].get_shape())
        shape = [len(self.parts[0]), *first]
        if self.concat_dim is not None:
            shape[self.concat_dim] = sum(part[0].get_shape()[self.concat_dim - 1] for part in self.parts)
        return tuple(shape)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        experts = range(len(self.parts[0]))[index[0]]
        rest = list(index[1:])  # in the source tensors' dimensions
        if self.concat_dim is None:
            return torch.stack([self.parts[0][e][tuple(rest)] for e in experts])
        source_dim = self.concat_dim - 1
        wanted = index[self.concat_dim]
        start, stop = wanted.start or 0, wanted.stop if wanted.stop is not None else self.get_shape()[self.concat_dim]
        pieces, offset = [], 0
        for part in self.parts:
            size = part[0].get_shape()[source_dim]
            low, high = max(start, offset), min(stop, offset + size)
            if low < high:
                rest[source_dim] = slice(low - offset, high - offset)
                pieces.append(torch.stack([part[e][tuple(rest)] for e in experts]))
            offset += size
        return torch.cat(pieces, dim=self.concat_dim)


def _plan(operations: list) -> int | None:
    """The concatenation dim of a ``[MergeModulelist(dim=0)] (+ [Concatenate(dim)])`` converter; else one line."""
    names = [type(op).__name__ for op in operations]
    if names and names[0] == "MergeModulelist" and getattr(operations[0], "dim", 0) == 0:
        if names[1:] == []:
            return None
        if names[1:] == ["Concatenate"]:
            return int(operations[1].dim)
    raise CheckpointError(f"transformers converts this checkpoint with {names}; mtk reads only merged expert lists")


def converted_tensors(lookup: tuple[str, ...], keys: list[str], open_slice: Callable[[str], Slicer]) -> dict[str, Any]:
    """``{model tensor name: MergedSlicer, or the checkpoint key it is renamed from}`` for the keys that
    transformers' conversion mapping changes; ``{}`` when it has none. ``lookup``: the model's class name, then
    its ``model_type`` (transformers' own order: GPT-NeoX's ``embed_out`` -> ``lm_head`` is registered under
    ``GPTNeoXForCausalLM``)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    transforms: list[Any] = next((found for name in lookup if (found := get_checkpoint_conversion_mapping(name))), [])
    if not transforms:
        return {}
    renamed: dict[str, str] = {}
    groups: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    converters: dict[str, Any] = {}
    for key in keys:
        name, converter = key, None
        for transform in transforms:
            name, pattern = transform.rename_source_key(name)
            if pattern is not None and hasattr(transform, "operations"):
                converter, source = transform, pattern
        if converter is None:
            if name != key:
                renamed[name] = key
            continue
        groups[name][source].append(key)
        converters[name] = converter
    result: dict[str, Any] = dict(renamed)
    for name, by_source in groups.items():
        converter = converters[name]
        order = [p for p in converter.source_patterns if p in by_source]
        parts = [[open_slice(k) for k in sorted(by_source[p], key=_expert_order)] for p in order]
        sources = tuple(k for p in order for k in by_source[p])
        result[name] = MergedSlicer(parts, _plan(list(converter.operations)), sources)
    return result
