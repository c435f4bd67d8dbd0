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
from typing import Any, cast

import torch

from mtk import jsonio
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


def _whole(value: Any, *, none: bool = False) -> Any:
    """``value`` if it is a whole number (a JSON integer; ``None`` too where ``none``), else ``ValueError``: a
    crafted ``130.5`` was cut to 130 by ``int`` or failed as a slice index."""
    if (value is None and none) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ValueError(f"{value!r} is not a whole number")


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
            specs = jsonio.loads(handle.metadata["mtk_specs"])
        except (KeyError, TypeError, json.JSONDecodeError):  # (TypeError: metadata that is not a string)
            raise CheckpointError(f"{handle.path} has no mtk shard specs (not written by mtk save_state)") from None
        try:  # data from the file (possibly crafted, its checksum rewritten with it): one line if malformed
            for name, info in specs.items():
                dim, local_size = info["dim"], info["local_size"]
                ranges = tuple(tuple(_whole(n) for n in r) for r in info["ranges"])
                spec = ShardSpec(None if dim is None else _whole(dim), ranges, _whole(local_size, none=True))
                if not any(s == shard for s, _ in self.shards.get(name, [])):
                    self.shards.setdefault(name, []).append((shard, spec))
                self.full_shapes[name] = tuple(_whole(n) for n in info["full_shape"])
                if "tied_to" in info:
                    self.tied[name] = str(info["tied_to"])
                if not whole:
                    start, stop = (_whole(n) for n in info["flat"])
                    part.flat[name] = (start, stop)
                    part.shard_shapes[name] = tuple(_whole(n) for n in info["shard_shape"])
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            raise CheckpointError(
                f"{handle.path} has malformed mtk shard specs ({type(err).__name__}: {err}); not as mtk wrote it"
            ) from None

    def names(self) -> list[str]:
        """Every distinct tensor (a tied embedding's pipeline copy is the embedding: listed once)."""
        return [name for name in self.shards if name not in self.tied]

    def full(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The full, unpadded tensor ``name`` (merged from every rank that holds a piece). ``rows``: its rows
        ``[start, stop)`` alone (a rank's own experts), the only bytes read where no shard splits the rows."""
        if name not in self.shards:
            raise CheckpointError(f"{self.directory} has no tensor {name!r}")
        shards, rows_read = self.shards[name], self._rows_readable(name, rows)
        pieces = [(self._shard(s, name, name, optimizer=False, rows=rows_read), spec) for s, spec in shards]
        return self._merge(name, pieces, rows, rows_read)

    def _rows_readable(self, name: str, rows: tuple[int, int] | None) -> tuple[int, int] | None:
        """``rows`` where every shard of ``name`` holds whole rows of it (a TP split along another dimension)."""
        if rows is None:
            return None
        ndim = len(self.full_shapes[name])
        return None if any(spec.dim is not None and spec.dim % ndim == 0 for _, spec in self.shards[name]) else rows

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

    def full_optimizer_state(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``<param>::<state>`` merged like its parameter (``rows``: as :meth:`full`); scalars (AdamW's ``step``)
        are replicated."""
        self._open_optimizer()
        name = key.rpartition("::")[0]
        shards = [(s, spec) for s, spec in self.shards.get(name, []) if self._holds(s, key)]
        if not shards:
            raise CheckpointError(f"{self.directory}: no optimizer state {key!r}")
        rows_read = self._rows_readable(name, rows)
        first = self._shard(shards[0][0], key, name, optimizer=True, rows=rows_read)
        if first.dim() == 0:
            return first
        rest = [(self._shard(s, key, name, optimizer=True, rows=rows_read), spec) for s, spec in shards[1:]]
        return self._merge(name, [(first, shards[0][1]), *rest], rows, rows_read)

    def _holds(self, shard: int, key: str) -> bool:
        return any(key in part.file(optimizer=True) for part in self._parts[shard])

    def _shard(
        self, shard: int, key: str, name: str, *, optimizer: bool, rows: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """One (tp, pp) rank's tensor ``key`` (of parameter ``name``): its file's, or its pieces joined; ``rows``:
        only those rows of it, read alone (of the pieces, the runs that hold them)."""
        files = [part.file(optimizer) for part in self._parts[shard]]
        parts = [part for part, handle in zip(self._parts[shard], files) if key in handle]
        files = [part.file(optimizer) for part in parts]
        if self._piece_ids == [None] or not parts:
            return self._read_rows(files[0].get_slice(key), rows) if parts else self._missing(shard, key)
        runs = []
        wanted: tuple[int, int] | None = None  # the elements of ``rows`` in the shard's row-major order
        for part, handle in zip(parts, files):
            slicer = handle.get_slice(key)
            if not slicer.get_shape():  # a scalar, saved whole by piece 0
                return self._read_all(slicer)
            if name not in part.flat:
                raise CheckpointError(f"{handle.path} holds {key!r} but no range of {name!r} for it")
            (start, stop), shape = part.flat[name], part.shard_shapes[name]
            if rows is not None:
                row = math.prod(shape[1:])
                wanted = (rows[0] * row, rows[1] * row)
                low, high = max(start, wanted[0]), min(stop, wanted[1])
                if low < high:
                    runs.append(((low, high), slicer[(slice(low - start, high - start),)], shape, handle.path))
                continue
            runs.append(((start, stop), self._read_all(slicer), shape, handle.path))
        if not runs:
            raise CheckpointError(f"{self.directory}: no piece holds rows {rows} of {key!r}")
        runs.sort(key=lambda run: run[0][0])
        shape = runs[0][2]
        self._check_join(
            key, [(span, value.numel(), path) for span, value, _, path in runs], wanted or (0, math.prod(shape))
        )
        held = shape if rows is None else (rows[1] - rows[0], *shape[1:])
        return torch.cat([value for _, value, _, _ in runs]).reshape(held)

    def _check_join(self, key: str, runs: list[tuple[tuple[int, int], int, Path]], span: tuple[int, int]) -> None:
        """``runs`` (each piece's elements ``[start, stop)``, the count it stores, its file), sorted, hold the elements
        ``span`` of ``key``'s shard exactly once."""
        begin, end = span
        at = begin
        for (start, stop), stored, path in runs:
            if start != at or stored != stop - start:
                raise CheckpointError(
                    f"{path}: the pieces of {key!r} do not join (elements [{start}, {stop}) after {at})"
                )
            at = stop
        if at != end:
            raise CheckpointError(
                f"{self.directory}: the pieces of {key!r} hold {at - begin} of {end - begin} elements"
            )

    def check_complete(self, optimizer: bool) -> None:
        """Every tensor (and, with ``optimizer``, every optimizer state) rebuilds whole from what the files hold, read
        from their headers alone: each shard's pieces join without gap or overlap, each shard has the shape its spec
        says, and the shards of a split tensor cover it. Checksums prove the files are the ones saved; this proves
        what was saved is whole (a crafted or damaged layout would otherwise be found only when a resume or an
        export reaches the tensor)."""
        for name, shards in self.shards.items():
            self._check_covered(name, name, [s for s, _ in shards], optimizer=False)
            self._check_dtype(name, [s for s, _ in shards], optimizer=False)
        if not optimizer:
            return
        self._open_optimizer()
        for key in self.optimizer_keys():
            name = key.rpartition("::")[0]
            if name not in self.shards:
                raise CheckpointError(f"{self.directory}: optimizer state {key!r} belongs to no tensor of the model")
            held = [s for s, _ in self.shards[name] if self._holds(s, key)]
            shape = self._stored_shape(held[0], key, optimizer=True)
            if not shape or shape != self._expected_shape(name, held[0]):
                continue  # a scalar (AdamW's step), or a state not shaped like its parameter (Adafactor's factors)
            self._check_covered(key, name, held, optimizer=True)
            self._check_dtype(key, held, optimizer=True)

    def check_replicas_agree(self, optimizer: bool) -> None:
        """Every tensor each TP rank of a stage holds whole (norms, biases, experts kept whole) is the same in every
        TP rank's file, and with ``optimizer`` so are its optimizer states (steps included): files taken from two
        saves (crafted, or mixed from two runs) would otherwise load at another layout, verify and export as one
        model, whichever TP rank's copy a reader takes. Reads each such tensor once per TP rank."""
        keys = [(name, name, False) for name in self.shards]
        if optimizer:
            self._open_optimizer()
            keys += [(key, key.rpartition("::")[0], True) for key in self.optimizer_keys()]
        for key, name, of_optimizer in keys:
            stages: dict[int, list[int]] = {}
            for shard, spec in self.shards.get(name, []):
                if spec.is_replicated and (not of_optimizer or self._holds(shard, key)):
                    stages.setdefault(self.ranks[shard][1], []).append(shard)
            for held in stages.values():
                if len(held) < 2:  # one TP rank's file (TP 1): nothing to compare, nothing to read
                    continue
                first = self._shard(held[0], key, name, optimizer=of_optimizer)
                for shard in held[1:]:
                    if not torch.equal(self._shard(shard, key, name, optimizer=of_optimizer), first):
                        ranks = f"{self.ranks[held[0]][0]} and {self.ranks[shard][0]}"
                        raise CheckpointError(
                            f"{self.directory}: {key!r} differs between the files of TP ranks {ranks}, though each "
                            "holds it whole; the files are not from one save (crafted, or mixed from two runs): use "
                            "another checkpoint"
                        )

    def _check_dtype(self, key: str, held: list[int], *, optimizer: bool) -> None:
        """Every shard and piece of ``key`` holds it in one dtype, for a parameter a dtype it trains in (fp64, fp32,
        bf16, fp16): an integer (the bytes reinterpreted, ``1e9`` weights) or float8 dtype, or shards that disagree,
        are not what mtk wrote. An optimizer state may be of any dtype (an 8-bit optimizer's quantized moments)."""
        dtypes = {
            part.file(optimizer).get_slice(key).dtype
            for shard in held
            for part in self._parts[shard]
            if key in part.file(optimizer)
        }
        if len(dtypes) > 1:
            named = sorted(str(d).removeprefix("torch.") for d in dtypes)
            raise CheckpointError(f"{self.directory}: the shards of {key!r} disagree on its dtype ({named})")
        dtype = next(iter(dtypes), None)
        if dtype is not None and not optimizer and (not dtype.is_floating_point or dtype.itemsize < 2):
            shown = str(dtype).removeprefix("torch.")
            raise CheckpointError(f"{self.directory}: {key!r} is stored as {shown}; mtk saves fp64, fp32, bf16, fp16")

    def _expected_shape(self, name: str, shard: int) -> tuple[int, ...]:
        """The shape shard ``shard`` of ``name`` has by its spec (its slice along the split dimension, padded)."""
        full, spec = list(self.full_shapes[name]), dict(self.shards[name])[shard]
        if spec.dim is not None:
            full[spec.dim % len(full)] = spec.local_size if spec.local_size is not None else spec.taken()
        return tuple(full)

    def _check_covered(self, key: str, name: str, held: list[int], *, optimizer: bool) -> None:
        full, specs = self.full_shapes[name], dict(self.shards[name])
        for shard in held:
            shape, spec = self._stored_shape(shard, key, optimizer=optimizer), specs[shard]
            expected = self._expected_shape(name, shard)
            if spec.dim is not None:
                dim = spec.dim % len(full)
                if any(not 0 <= start <= stop <= full[dim] for start, stop in spec.ranges):
                    raise CheckpointError(f"{self.directory}: {key!r} of shard {self.ranks[shard]} reaches outside it")
            if tuple(shape) != tuple(expected):
                raise CheckpointError(
                    f"{self.directory}: shard {self.ranks[shard]} holds {key!r} as {tuple(shape)}, its spec says "
                    f"{tuple(expected)}"
                )
        split = [specs[s] for s in held]
        if any(spec.dim is None for spec in split):
            return
        dim = cast(int, split[0].dim) % len(full)
        covered = torch.zeros(full[dim], dtype=torch.bool)
        for spec in split:
            for start, stop in spec.ranges:
                covered[start:stop] = True
        if not bool(covered.all()):
            raise CheckpointError(
                f"{self.directory}: the shards of {key!r} hold {int(covered.sum())} of its {full[dim]} entries along "
                f"dimension {dim}"
            )

    def _stored_shape(self, shard: int, key: str, *, optimizer: bool) -> tuple[int, ...]:
        """The shape of shard ``shard`` of ``key`` as its file holds it, or (pieces) as its pieces join to, checked."""
        parts = [part for part in self._parts[shard] if key in part.file(optimizer)]
        if not parts:
            self._missing(shard, key)
        if self._piece_ids == [None]:
            return parts[0].file(optimizer).get_slice(key).get_shape()
        name = key.rpartition("::")[0] if optimizer else key
        runs = []
        for part in parts:
            handle = part.file(optimizer)
            stored = handle.get_slice(key).get_shape()
            if not stored:
                return ()
            if name not in part.flat:
                raise CheckpointError(f"{handle.path} holds {key!r} but no range of {name!r} for it")
            runs.append((part.flat[name], math.prod(stored), handle.path))
        shapes = {part.shard_shapes[name] for part in parts}
        if len(shapes) != 1:
            raise CheckpointError(f"{self.directory}: the pieces of {key!r} disagree on its shape ({sorted(shapes)})")
        shape = shapes.pop()
        self._check_join(key, sorted(runs, key=lambda run: run[0][0]), (0, math.prod(shape)))
        return shape

    @classmethod
    def _read_rows(cls, slicer, rows: tuple[int, int] | None) -> torch.Tensor:
        if rows is None or not slicer.get_shape():
            return cls._read_all(slicer)
        return slicer[(slice(*rows), *(slice(None) for _ in slicer.get_shape()[1:]))]

    def _missing(self, shard: int, key: str) -> torch.Tensor:
        raise CheckpointError(f"{self.directory}: shard {self.ranks[shard]} holds no {key!r}")

    def _merge(
        self,
        name: str,
        pieces: list[tuple[torch.Tensor, ShardSpec]],
        rows: tuple[int, int] | None = None,
        rows_read: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """The full tensor, or its ``rows``: read alone (``rows_read``), else cut from the merged whole."""
        shape = self.full_shapes[name]
        if rows_read is not None:
            shape = (rows_read[1] - rows_read[0], *shape[1:])
        try:
            merged = merge_shards(pieces, shape)
        except ValueError as err:
            raise CheckpointError(f"{self.directory}: cannot rebuild {name} ({err})") from None
        return merged[rows[0] : rows[1]] if rows is not None and rows_read is None else merged

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
