"""Tensors split over data parallelism, seen as flat pieces: what a checkpoint saves when each rank writes its own.

Two engines split a TP shard again over the DP ranks. FSDP2 splits dim 0 as ``torch.chunk`` does
(``ceil(rows / count)`` rows per piece, the last ones shorter or empty) and keeps each piece as a ``DTensor``;
DeepSpeed's ZeRO-3 flattens the tensor and gives each rank ``ceil(numel / count)`` elements of it
(``param.ds_tensor``, padded at the end with bytes never written for a frozen parameter). Either way a piece is one
contiguous run of the row-major shard's elements, so a checkpoint stores it flat with its ``[start, stop)`` and the
shard's shape, and a reader joins the runs back (:mod:`mtk.checkpoint.reader`) whatever split wrote them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Shard

__all__ = ["Piece", "flat_piece", "shard_shape"]


@dataclass(frozen=True)
class Piece:
    """This rank's place among the ranks that split every TP shard: piece ``index`` of ``count``. ``writes``:
    whether its pieces are saved from this rank (HSDP's first replica; the other replicas hold the same).
    ``experts``: whether its piece holds its experts spread over EP (the first of the ranks holding them saves them,
    as a run of the tensor of every expert: :func:`~mtk.parallel.expert_parallel.experts_piece`; a LoRA factor
    whose experts are no run whole, from EP rank 0: :func:`~mtk.parallel.expert_parallel.whole_piece`)."""

    index: int
    count: int
    writes: bool = True
    experts: bool = True


def shard_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The whole TP shard's shape (a ZeRO-3 parameter's own ``shape`` is empty outside a gather)."""
    return tuple(getattr(tensor, "ds_shape", tensor.shape))


def flat_piece(tensor: torch.Tensor, piece: Piece) -> tuple[torch.Tensor, tuple[int, int]] | None:
    """This rank's elements of ``tensor``'s TP shard, flat, and where they sit in it: ``(values, (start, stop))``;
    ``None`` when it holds none to save. A tensor not split over DP (Adam's ``step``, a parameter outside every
    FSDP2 unit) is saved whole by piece 0."""
    if isinstance(tensor, DTensor):
        return _fsdp2_piece(tensor, piece)
    if hasattr(tensor, "ds_tensor"):
        return _zero3_piece(tensor, piece)
    return (tensor.detach().reshape(-1), (0, tensor.numel())) if piece.index == 0 else None


def _fsdp2_piece(tensor: DTensor, piece: Piece) -> tuple[torch.Tensor, tuple[int, int]] | None:
    if tensor.placements[-1] != Shard(0):
        raise RuntimeError(f"a DP-split tensor with placements {tensor.placements}: mtk saves FSDP2's Shard(0) only")
    rows, held = tensor.shape[0], tensor.to_local().detach()
    per_piece = -(-rows // piece.count)
    start, stop = min(piece.index * per_piece, rows), min((piece.index + 1) * per_piece, rows)
    if held.shape[0] != stop - start:
        raise RuntimeError(f"FSDP2 holds {held.shape[0]} rows here, not rows [{start}, {stop}) of {rows}")
    row = math.prod(tensor.shape[1:])
    return (held.reshape(-1), (start * row, stop * row)) if stop > start else None


def _zero3_piece(param: torch.Tensor, piece: Piece) -> tuple[torch.Tensor, tuple[int, int]] | None:
    held = param.ds_tensor.detach().reshape(-1)  # type: ignore[attr-defined]  # [ceil(numel / count)], padded
    numel = math.prod(shard_shape(param))
    start, stop = min(piece.index * held.numel(), numel), min((piece.index + 1) * held.numel(), numel)
    return (held[: stop - start], (start, stop)) if stop > start else None
