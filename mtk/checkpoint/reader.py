"""Full tensors out of a sharded checkpoint, whatever layout wrote it.

Every weights file of a checkpoint carries, per tensor, the full shape and the :class:`ShardSpec` of
the rank that wrote it. :class:`ShardedCheckpointReader` finds all the pieces of a tensor (one per TP
rank of the stage that holds it) and merges them; optimizer moments share their parameter's spec.
A checkpoint saved under FSDP2 holds each TP shard in flat pieces, one file per DP rank that split it
(``pieces`` in the metadata): a shard is read by joining its pieces in element order, checked to cover
it exactly once, then merged as any other.
Export merges every tensor; a resume at another layout merges each one and cuts the new rank's shard
(:mod:`mtk.checkpoint.weights`, :mod:`mtk.checkpoint.optimizer`). One tensor is in memory at a time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtk.checkpoint.meta import CheckpointMeta
from mtk.checkpoint.paths import CheckpointPaths
from mtk.checkpoint.safetensors_slices import SafetensorsFile, open_safetensors
from mtk.errors import CheckpointError
from mtk.parallel.sharding import ShardSpec, merge_shards

__all__ = ["ShardedCheckpointReader"]


@dataclass
class _Part:
    """One file of a (tp, pp) rank's tensors: the whole shard of each, or (FSDP2) a flat piece of each."""

    model: SafetensorsFile
    flat: dict[str, tuple[int, int]] = field(default_factory=dict)  # tensor -> elements [start, stop) held
    shard_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    optimizer: SafetensorsFile | None = None  # opened when optimizer state is first read

    def file(self, optimizer: bool) -> SafetensorsFile:
        if not optimizer:
            return self.model
        assert self.optimizer is not None, "optimizer files are opened first"
        return self.optimizer


class ShardedCheckpointReader:
    """Reads full tensors from ``<checkpoint>/model`` (and ``/optimizer``) shard files."""

    def __init__(self, directory: str | Path, meta: CheckpointMeta) -> None:
        self.directory = Path(directory)
        self.paths = CheckpointPaths(self.directory)
        topology, count = meta.topology, meta.pieces
        self.ranks = [(t, p) for p in range(topology.pp_size) for t in range(topology.tp_size)]
        self._piece_ids: list[int | None] = [None] if count is None else list(range(count))
        self._parts: list[list[_Part]] = []
        self.shards: dict[str, list[tuple[int, ShardSpec]]] = {}  # tensor -> (shard index, its spec) per TP rank
        self.full_shapes: dict[str, tuple[int, ...]] = {}
        self.tied: dict[str, str] = {}  # a pipeline's last-stage copy of a tied embedding -> the embedding
        self._optimizer_open = False
        try:
            for t, p in self.ranks:
                parts: list[_Part] = []
                self._parts.append(parts)
                for piece in self._piece_ids:
                    parts.append(_Part(open_safetensors(self.paths.weights(t, p, piece))))
                    self._read_specs(len(self._parts) - 1, parts[-1], whole=piece is None)
        except BaseException:
            self.close()  # the files opened so far
            raise

    def _read_specs(self, shard: int, part: _Part, *, whole: bool) -> None:
        handle = part.model
        try:
            specs = json.loads(handle.metadata["mtk_specs"])
        except (KeyError, json.JSONDecodeError):
            raise CheckpointError(f"{handle.path} has no mtk shard specs (not written by mtk save_state)") from None
        try:  # data from the file (possibly crafted, its checksum rewritten with it): one line if malformed
            for name, info in specs.items():
                spec = ShardSpec(info["dim"], tuple(tuple(r) for r in info["ranges"]), info["local_size"])
                if not any(s == shard for s, _ in self.shards.get(name, [])):
                    self.shards.setdefault(name, []).append((shard, spec))
                self.full_shapes[name] = tuple(int(n) for n in info["full_shape"])
                if "tied_to" in info:
                    self.tied[name] = str(info["tied_to"])
                if not whole:
                    start, stop = (int(n) for n in info["flat"])
                    part.flat[name] = (start, stop)
                    part.shard_shapes[name] = tuple(int(n) for n in info["shard_shape"])
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            raise CheckpointError(
                f"{handle.path} has malformed mtk shard specs ({type(err).__name__}: {err}); not as mtk wrote it"
            ) from None

    def names(self) -> list[str]:
        """Every distinct tensor (a tied embedding's pipeline copy is the embedding: listed once)."""
        return [name for name in self.shards if name not in self.tied]

    def full(self, name: str) -> torch.Tensor:
        """The full, unpadded tensor ``name`` (merged from every rank that holds a piece)."""
        if name not in self.shards:
            raise CheckpointError(f"{self.directory} has no tensor {name!r}")
        shards = self.shards[name]
        return self._merge(name, [(self._shard(s, name, name, optimizer=False), spec) for s, spec in shards])

    def _open_optimizer(self) -> None:
        """The optimizer file beside each model file (opened on first use)."""
        if self._optimizer_open:
            return
        for (t, p), parts in zip(self.ranks, self._parts):
            for piece, part in zip(self._piece_ids, parts):
                part.optimizer = open_safetensors(self.paths.optimizer(t, p, piece=piece).with_suffix(".safetensors"))
        self._optimizer_open = True

    def optimizer_keys(self) -> list[str]:
        self._open_optimizer()
        return sorted({key for parts in self._parts for part in parts for key in part.file(optimizer=True).keys()})

    def full_optimizer_state(self, key: str) -> torch.Tensor:
        """``<param>::<state>`` merged like its parameter; scalars (AdamW's ``step``) are replicated."""
        self._open_optimizer()
        name = key.rpartition("::")[0]
        shards = [(s, spec) for s, spec in self.shards.get(name, []) if self._holds(s, key)]
        if not shards:
            raise CheckpointError(f"{self.directory}: no optimizer state {key!r}")
        first = self._shard(shards[0][0], key, name, optimizer=True)
        if first.dim() == 0:
            return first
        return self._merge(
            name,
            [(first, shards[0][1])] + [(self._shard(s, key, name, optimizer=True), spec) for s, spec in shards[1:]],
        )

    def _holds(self, shard: int, key: str) -> bool:
        return any(key in part.file(optimizer=True) for part in self._parts[shard])

    def _shard(self, shard: int, key: str, name: str, *, optimizer: bool) -> torch.Tensor:
        """One (tp, pp) rank's tensor ``key`` (of parameter ``name``): its file's, or its pieces joined."""
        files = [part.file(optimizer) for part in self._parts[shard]]
        parts = [part for part, handle in zip(self._parts[shard], files) if key in handle]
        files = [part.file(optimizer) for part in parts]
        if self._piece_ids == [None] or not parts:
            return self._read_all(files[0].get_slice(key)) if parts else self._missing(shard, key)
        runs = []
        for part, handle in zip(parts, files):
            value = self._read_all(handle.get_slice(key))
            if value.dim() == 0:  # a scalar, saved whole by piece 0
                return value
            if name not in part.flat:
                raise CheckpointError(f"{handle.path} holds {key!r} but no range of {name!r} for it")
            runs.append((part.flat[name], value, part.shard_shapes[name], handle.path))
        runs.sort(key=lambda run: run[0][0])
        shape = runs[0][2]
        end = 0
        for (start, stop), value, _, path in runs:
            if start != end or value.numel() != stop - start:
                raise CheckpointError(
                    f"{path}: the pieces of {key!r} do not join (elements [{start}, {stop}) after {end})"
                )
            end = stop
        if end != math.prod(shape):
            raise CheckpointError(f"{self.directory}: the pieces of {key!r} hold {end} of {math.prod(shape)} elements")
        return torch.cat([value for _, value, _, _ in runs]).reshape(shape)

    def _missing(self, shard: int, key: str) -> torch.Tensor:
        raise CheckpointError(f"{self.directory}: shard {self.ranks[shard]} holds no {key!r}")

    def _merge(self, name: str, pieces: list[tuple[torch.Tensor, ShardSpec]]) -> torch.Tensor:
        try:
            return merge_shards(pieces, self.full_shapes[name])
        except ValueError as err:
            raise CheckpointError(f"{self.directory}: cannot rebuild {name} ({err})") from None

    @staticmethod
    def _read_all(slicer) -> torch.Tensor:
        return slicer[tuple(slice(None) for _ in slicer.get_shape())]

    def close(self) -> None:
        for parts in self._parts:
            for part in parts:
                part.model.close()
                if part.optimizer is not None:
                    part.optimizer.close()

    def __enter__(self) -> ShardedCheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
