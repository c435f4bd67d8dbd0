"""Which piece of a full tensor a rank holds, as data.

A :class:`ShardSpec` says: along ``dim``, take these ``ranges`` of the full tensor, concatenate them,
and zero-pad to ``local_size``. It describes every split mtk makes (column, row, fused parts, vocab
with padding, replicated kv heads), so one description serves three jobs:

- cutting a shard out of a materialized tensor (random init, tests),
- reading only that shard from a safetensors file (``get_slice``: no rank reads the full tensor),
- putting shards back together for export.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["REPLICATED", "ShardSpec", "merge_shards", "take_shard"]


@dataclass(frozen=True)
class ShardSpec:
    """This rank's piece of a full tensor.

    Attributes:
        dim: dimension that is split; ``None`` for a replicated tensor (the whole tensor).
        ranges: ``(start, stop)`` ranges of the full tensor along ``dim``, concatenated in order.
        local_size: size of the local tensor along ``dim`` after zero padding (vocab padding); ``None``
            means the ranges' total, no padding.
    """

    dim: int | None
    ranges: tuple[tuple[int, int], ...] = ()
    local_size: int | None = None

    @property
    def is_replicated(self) -> bool:
        return self.dim is None

    def taken(self) -> int:
        return sum(stop - start for start, stop in self.ranges)


REPLICATED = ShardSpec(dim=None)


def take_shard(
    spec: ShardSpec,
    full_shape: tuple[int, ...],
    read: Callable[[tuple[slice, ...]], torch.Tensor],
) -> torch.Tensor:
    """Build the local tensor of ``spec`` from ``read(index)``, which returns ``full[index]``.

    ``read`` is ``full.__getitem__`` for a tensor in memory, or a safetensors slice's ``__getitem__``
    so that only the needed bytes are read from disk.
    """
    if spec.is_replicated:
        return read(tuple(slice(None) for _ in full_shape))
    assert spec.dim is not None  # a split spec names its dimension
    dim = spec.dim % len(full_shape)
    pieces = []
    for start, stop in spec.ranges:
        index = tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(full_shape)))
        pieces.append(read(index))
    local = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)
    if spec.local_size is not None and spec.local_size > local.shape[dim]:
        pad_shape = list(local.shape)
        pad_shape[dim] = spec.local_size - local.shape[dim]
        local = torch.cat([local, local.new_zeros(pad_shape)], dim=dim)
    return local


def merge_shards(pieces: list[tuple[torch.Tensor, ShardSpec]], full_shape: tuple[int, ...]) -> torch.Tensor:
    """Rebuild a full tensor from every rank's ``(local tensor, spec)``; the inverse of :func:`take_shard`.

    Padding is dropped. Ranges held by several ranks (replicated kv heads) must agree; the first is
    kept. Raises when some part of the full tensor is held by nobody.
    """
    first_local, first_spec = pieces[0]
    if first_spec.is_replicated:
        return first_local.clone()
    assert first_spec.dim is not None
    dim = first_spec.dim % len(full_shape)
    full = first_local.new_empty(full_shape)
    covered = torch.zeros(full_shape[dim], dtype=torch.bool)
    for local, spec in pieces:
        offset = 0
        for start, stop in spec.ranges:
            if stop > start and not bool(covered[start:stop].all()):
                full.narrow(dim, start, stop - start).copy_(local.narrow(dim, offset, stop - start))
                covered[start:stop] = True
            offset += stop - start
    if not bool(covered.all()):
        missing = int((~covered).sum())
        raise ValueError(f"shards cover {full_shape[dim] - missing} of {full_shape[dim]} entries along dim {dim}")
    return full
