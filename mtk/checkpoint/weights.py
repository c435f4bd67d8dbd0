"""Model weights in a checkpoint: one safetensors file per (tp, pp) rank, each tensor with its ShardSpec.

Saved and loaded as is at the same layout; at another layout every tensor is merged from the old
shards (:class:`~mtk.checkpoint.reader.ShardedCheckpointReader`) and this rank's shard cut from it. The
persistent buffers HF saves with the weights are kept whole beside them (an export writes them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from mtk.checkpoint.base_model import checkpointed_buffers, checkpointed_parameters
from mtk.checkpoint.labels import KEY
from mtk.errors import CheckpointError
from mtk.parallel.expert_parallel import experts_piece, spread_layout, whole_piece
from mtk.parallel.fsdp import copy_into
from mtk.parallel.gather import full_shape_and_spec
from mtk.parallel.parameters import param_info
from mtk.parallel.pieces import Piece, flat_piece, shard_shape
from mtk.parallel.sharding import take_shard

__all__ = ["load_buffers", "load_weights", "read_safetensors", "reshard_weights", "save_weights", "source_name"]


def save_weights(model: nn.Module, path: Path, piece: Piece | None = None, *, label: str | None = None) -> None:
    """This rank's TP shard of every checkpointed tensor, with its spec; with ``piece`` (FSDP2, ZeRO-3, EP), only
    this rank's flat piece of each, with the elements of the shard it covers (``flat``) and the shard's shape: each
    rank writes what it holds (under EP: its own experts, and piece 0 the dense tensors), gathering nothing but a
    LoRA factor of expert tensors whose experts are no run (``lora_B``: EP rank 0 writes it whole).
    ``label``: the save's (:mod:`~mtk.checkpoint.labels`), kept in the header."""
    tensors: dict[str, torch.Tensor] = {}
    specs: dict[str, dict[str, Any]] = {}
    for name, param in checkpointed_parameters(model):
        full_shape, spec = full_shape_and_spec(model, name)
        record: dict[str, Any] = {
            "full_shape": list(full_shape),
            "dim": spec.dim,
            "ranges": [list(r) for r in spec.ranges],
            "local_size": spec.local_size,
        }
        if param_info(param).pipeline_duplicate:  # last stage's copy of a tied embedding
            record["tied_to"] = param_info(param).tied_to
        layout = spread_layout(model, name)
        if piece is None:
            tensors[name] = param.detach().contiguous().cpu()
        elif layout is not None:  # this EP rank's experts: its run of the tensor of every expert
            if not piece.experts:  # another rank holding the same experts saves them
                continue
            run = experts_piece(param, layout) or whole_piece(param, layout)  # (whole: collective over EP)
            if run is None:  # a tensor whose experts are no run (lora_B): EP rank 0 writes it whole, not this rank
                continue
            values, flat, whole = run
            tensors[name] = values.contiguous().cpu()  # [stop - start]
            record.update(flat=list(flat), shard_shape=list(whole))
        else:
            held = flat_piece(param, piece)
            if held is None:
                continue
            tensors[name] = held[0].cpu()  # [stop - start]
            record.update(flat=list(held[1]), shard_shape=list(shard_shape(param)))
        specs[name] = record
    for name, buffer in checkpointed_buffers(model):  # whole on every rank that holds its layer
        record = {"full_shape": list(buffer.shape), "dim": None, "ranges": [], "local_size": None}
        if piece is None:
            tensors[name] = buffer.detach().contiguous().cpu()
        else:  # piece 0 of the dense tensors writes it, as one run
            held = flat_piece(buffer, piece)
            if held is None:
                continue
            tensors[name] = held[0].contiguous().cpu()
            record.update(flat=list(held[1]), shard_shape=list(buffer.shape))
        specs[name] = record
    save_file(tensors, str(path), metadata={"mtk_specs": json.dumps(specs), **({KEY: label} if label else {})})


OTHER_SHAPES = (
    "the checkpoint was written for a model of other shapes (another --model, number of labels or LoRA rank): "
    "resume it with the model and settings it was written with"
)


def load_weights(model: nn.Module, path: Path) -> None:
    """This rank's shard file at the layout it was saved at, each tensor as is. The file's own record of which part
    of each tensor it holds (``mtk_specs``) must be this rank's: TP ranks' files of one tensor have the same shape,
    so a file of another rank (swapped, copied over) would load without a word and train on the wrong rows."""
    tensors = read_safetensors(path)
    params = dict(checkpointed_parameters(model))
    buffers = {name: buffer for name, buffer in checkpointed_buffers(model) if name in tensors}  # (older saves: none)
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params) - set(buffers))
    if missing or unexpected:
        raise CheckpointError(f"{path} does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    recorded = _recorded_specs(path)
    with torch.no_grad():
        for name, param in {**params, **buffers}.items():
            if tensors[name].shape != param.shape:
                raise CheckpointError(
                    f"{path}: {name} has shape {tuple(tensors[name].shape)}, model has {tuple(param.shape)}; "
                    f"{OTHER_SHAPES}"
                )
            _check_dtype(f"{path}: {name}", tensors[name], param)
            if recorded is not None:
                _check_own_part(path, name, recorded.get(name), full_shape_and_spec(model, name))
            copy_into(param, tensors[name])


def _recorded_specs(path: Path) -> dict[str, Any] | None:
    """The ``mtk_specs`` a shard file's header records (``None``: a file without them, read as before)."""
    try:
        with safe_open(str(path), "pt") as handle:
            text = (handle.metadata() or {}).get("mtk_specs")
        specs = json.loads(text) if text is not None else None
    except Exception as err:  # safetensors raises its own types; a header that is not JSON
        raise CheckpointError(f"{path}: its header's tensor records cannot be read ({err})") from None
    if specs is not None and not isinstance(specs, dict):
        raise CheckpointError(f"{path}: its header's tensor records are not a table; the file is damaged")
    return specs


def _check_own_part(path: Path, name: str, record: Any, own: tuple) -> None:
    """``record`` (the file's entry for ``name``) holds the part of the tensor this rank holds (``own``: its full
    shape and spec)."""
    shape, spec = own
    wanted = {"full_shape": list(shape), "dim": spec.dim, "ranges": [list(r) for r in spec.ranges]}
    held = {key: record.get(key) for key in wanted} if isinstance(record, dict) else None
    if held != wanted:
        raise CheckpointError(
            f"{path}: {name} holds {_part(held)} of the tensor, this rank holds {_part(wanted)}: the file is another "
            "rank's (swapped or copied over) or damaged; use the checkpoint as it was saved"
        )


def _part(record: dict[str, Any] | None) -> str:
    if record is None:
        return "an unrecorded part"
    if record["dim"] is None:
        return f"the whole {tuple(record['full_shape'] or ())}"
    return f"ranges {record['ranges']} of dim {record['dim']} of {tuple(record['full_shape'] or ())}"


def _check_dtype(what: str, stored: torch.Tensor, param: torch.Tensor) -> None:
    """A parameter is restored from values of its own dtype, as mtk saves it: an integer tensor (a header retyped,
    its checksum rewritten with it) would load as ``1e9`` weights, a float8 or float16 one as silently rounded ones,
    and a run in another dtype than the checkpoint's is not the run it continues."""
    if stored.dtype != param.dtype:
        saved, wanted = (str(d).removeprefix("torch.") for d in (stored.dtype, param.dtype))
        raise CheckpointError(
            f"{what} is stored as {saved}, this run's model holds it as {wanted}: resume in the dtype the checkpoint "
            "was trained in"
        )


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        return load_file(str(path))
    except Exception as err:  # safetensors raises its own types for corrupt files
        raise CheckpointError(f"{path} is not a readable safetensors file ({err})") from None


def source_name(model: nn.Module, name: str, available) -> str:
    """The checkpoint's name for ``name``: itself, or for a pipeline's copy of a tied embedding
    restored from a checkpoint that stored only the embedding, the embedding's name."""
    if name in available:
        return name
    return param_info(model.get_parameter(name)).tied_to or name


def own_rows(model: nn.Module, name: str) -> tuple[int, int] | None:
    """The rows ``[start, stop)`` of the whole tensor that hold parameter ``name``'s experts where EP spread it, to
    read those alone (``None``: read the whole tensor, then :func:`own_part` keeps this rank's experts)."""
    layout = spread_layout(model, name)
    return None if layout is None else layout.own_rows()


def own_part(model: nn.Module, name: str, whole: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    """This rank's experts of ``whole`` (read as ``rows``, or whole where :func:`own_rows` gave none) for parameter
    ``name``; ``whole`` itself where EP did not spread it or the rows were read alone."""
    layout = spread_layout(model, name)
    return layout.own(whole) if layout is not None and rows is None else whole


def reshard_weights(model: nn.Module, reader) -> None:
    available = set(reader.shards)
    with torch.no_grad():
        for name, param in checkpointed_parameters(model):
            shape, spec = full_shape_and_spec(model, name)
            rows = own_rows(model, name)
            source = source_name(model, name, available)
            layout = spread_layout(model, name)
            if layout is not None:  # this EP rank's experts: [E, ...] -> [E/ep, ...], then its TP shard
                whole = reader.full_shapes.get(source)
                if whole is not None and tuple(whole) != tuple(shape):
                    raise CheckpointError(
                        f"{name}: checkpoint has shape {tuple(whole)}, this model {tuple(shape)}; {OTHER_SHAPES}"
                    )
                shape = layout.own_shape(tuple(shape))
            full = own_part(model, name, reader.full(source, rows=rows), rows)
            if tuple(full.shape) != tuple(shape):
                raise CheckpointError(
                    f"{name}: checkpoint has shape {tuple(full.shape)}, this model {tuple(shape)}; {OTHER_SHAPES}"
                )
            _check_dtype(f"{reader.directory}: {name}", full, param)
            copy_into(param, take_shard(spec, shape, full.__getitem__))
    load_buffers(model, reader)


def load_buffers(model: nn.Module, reader) -> None:
    """The persistent buffers the checkpoint holds, whole (a checkpoint saved before mtk kept them holds none: the
    model keeps the values it was built or loaded with)."""
    with torch.no_grad():
        for name, buffer in checkpointed_buffers(model):
            if name not in reader.shards:
                continue
            full = reader.full(name)
            if tuple(full.shape) != tuple(buffer.shape):
                raise CheckpointError(
                    f"{name}: checkpoint has shape {tuple(full.shape)}, this model {tuple(buffer.shape)}; "
                    f"{OTHER_SHAPES}"
                )
            _check_dtype(f"{reader.directory}: {name}", full, buffer)
            buffer.copy_(full)
