"""Full tensors out of a sharded checkpoint, whatever layout wrote it.

Every weights file of a checkpoint carries, per tensor, the full shape and the :class:`ShardSpec` of
the rank that wrote it. :class:`ShardedCheckpointReader` finds all the pieces of a tensor (one per TP
rank of the stage that holds it) and merges them; optimizer moments share their parameter's spec.
Export merges every tensor; a resume at another layout merges each one and cuts the new rank's shard
(:mod:`mtk.checkpoint.weights`, :mod:`mtk.checkpoint.optimizer`). One tensor is in memory at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mtk.checkpoint.paths import CheckpointPaths
from mtk.checkpoint.safetensors_slices import SafetensorsFile, open_safetensors
from mtk.errors import CheckpointError
from mtk.parallel.layout import Layout
from mtk.parallel.sharding import ShardSpec, merge_shards

__all__ = ["ShardedCheckpointReader"]


class ShardedCheckpointReader:
    """Reads full tensors from ``<checkpoint>/model`` (and ``/optimizer``) shard files."""

    def __init__(self, directory: str | Path, topology: Layout) -> None:
        self.directory = Path(directory)
        self.paths = CheckpointPaths(self.directory)
        self.ranks = [(t, p) for p in range(topology.pp_size) for t in range(topology.tp_size)]
        self.model_files = [self.paths.weights(t, p) for t, p in self.ranks]
        self._handles = [open_safetensors(path) for path in self.model_files]
        self.pieces: dict[str, list[tuple[SafetensorsFile, ShardSpec]]] = {}
        self.full_shapes: dict[str, tuple[int, ...]] = {}
        self.tied: dict[str, str] = {}  # a pipeline's last-stage copy of a tied embedding -> the embedding
        for handle in self._handles:
            try:
                specs = json.loads(handle.metadata["mtk_specs"])
            except (KeyError, json.JSONDecodeError):
                raise CheckpointError(
                    f"{handle.path} has no mtk shard specs (not written by mtk save_state)"
                ) from None
            try:  # data from the file (possibly crafted, its checksum rewritten with it): one line if malformed
                for name, info in specs.items():
                    spec = ShardSpec(info["dim"], tuple(tuple(r) for r in info["ranges"]), info["local_size"])
                    self.pieces.setdefault(name, []).append((handle, spec))
                    self.full_shapes[name] = tuple(int(n) for n in info["full_shape"])
                    if "tied_to" in info:
                        self.tied[name] = str(info["tied_to"])
            except (AttributeError, KeyError, TypeError, ValueError) as err:
                raise CheckpointError(
                    f"{handle.path} has malformed mtk shard specs ({type(err).__name__}: {err}); not as mtk wrote it"
                ) from None
        self._optimizer_handles: list[SafetensorsFile] | None = None
        self._optimizer_keys: list[set[str]] = []

    def names(self) -> list[str]:
        """Every distinct tensor (a tied embedding's pipeline copy is the embedding: listed once)."""
        return [name for name in self.pieces if name not in self.tied]

    def full(self, name: str) -> torch.Tensor:
        """The full, unpadded tensor ``name`` (merged from every rank that holds a piece)."""
        if name not in self.pieces:
            raise CheckpointError(f"{self.directory} has no tensor {name!r}")
        return self._merge(name, [(h.get_slice(name), spec) for h, spec in self.pieces[name]])

    def optimizer_files(self) -> list[SafetensorsFile]:
        """The optimizer shard of each model shard, in the same order (opened on first use)."""
        if self._optimizer_handles is None:
            stems = [self.paths.optimizer(t, p) for t, p in self.ranks]
            self._optimizer_handles = [open_safetensors(stem.with_suffix(".safetensors")) for stem in stems]
            self._optimizer_keys = [set(h.keys()) for h in self._optimizer_handles]
        return self._optimizer_handles

    def optimizer_keys(self) -> list[str]:
        self.optimizer_files()
        return sorted(set().union(*self._optimizer_keys))

    def full_optimizer_state(self, key: str) -> torch.Tensor:
        """``<param>::<state>`` merged like its parameter; scalars (AdamW's ``step``) are replicated."""
        name = key.rpartition("::")[0]
        files = dict(zip((id(h) for h in self._handles), zip(self.optimizer_files(), self._optimizer_keys)))
        slices = [
            (files[id(h)][0].get_slice(key), spec) for h, spec in self.pieces.get(name, []) if key in files[id(h)][1]
        ]
        if not slices:
            raise CheckpointError(f"{self.directory}: no optimizer state {key!r}")
        if tuple(slices[0][0].get_shape()) == ():
            return self._read_all(slices[0][0])
        return self._merge(name, slices)

    def _merge(self, name: str, slices: list) -> torch.Tensor:
        shape = self.full_shapes[name]
        pieces = [(self._read_all(slicer), spec) for slicer, spec in slices]
        try:
            return merge_shards(pieces, shape)
        except ValueError as err:
            raise CheckpointError(f"{self.directory}: cannot rebuild {name} ({err})") from None

    @staticmethod
    def _read_all(slicer) -> torch.Tensor:
        return slicer[tuple(slice(None) for _ in slicer.get_shape())]

    def close(self) -> None:
        for handle in self._handles + (self._optimizer_handles or []):
            handle.close()

    def __enter__(self) -> ShardedCheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
