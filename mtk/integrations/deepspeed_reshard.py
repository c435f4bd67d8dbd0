"""A DeepSpeed ZeRO-3 checkpoint resumed at another TP, CP or DP layout, through mtk's own files.

DeepSpeed's own state (``step_N/deepspeed/``) is flat fp32 partitions whose cut depends on the DP size and on
what TP made of each weight; it resumes at the same layout only. So a ZeRO-3 save also writes, beside the
weights each rank saves as its piece, its piece of every parameter's optimizer state in mtk's format
(``optimizer/tpXX-ppYY-pieceZZ.safetensors``: ``<name>::exp_avg``, ..., ``<name>::master`` for the fp32 master
of a bf16 weight, ``<name>::step``), read back through DeepSpeed's documented per-parameter API
(``safe_get_local_optimizer_state`` / ``safe_set_local_*``). At another layout each tensor is merged from the
checkpoint's pieces (:class:`~mtk.checkpoint.reader.ShardedCheckpointReader`), this rank's TP shard cut as
anywhere else, and this rank's ZeRO-3 partition of it set into the engine. The scheduler and the engine's step
counters follow; the data position is the caller's (it knows the batch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import save_file
from torch import nn

from mtk import jsonio
from mtk.checkpoint.base_model import checkpointed_parameters
from mtk.checkpoint.labels import KEY
from mtk.checkpoint.meta import CheckpointMeta
from mtk.checkpoint.paths import CheckpointPaths, reading
from mtk.checkpoint.reader import ShardedCheckpointReader
from mtk.checkpoint.weights import load_buffers, source_name
from mtk.errors import CheckpointError
from mtk.parallel.gather import full_shape_and_spec
from mtk.parallel.pieces import Piece, flat_piece
from mtk.parallel.sharding import take_shard
from mtk.parallel.state import ParallelState

__all__ = ["inner_optimizer", "load_at_another_layout", "save_optimizer_pieces"]

_MASTER, _STEP = "master", "step"


def inner_optimizer(engine) -> Any:
    """The torch optimizer DeepSpeed steps over this rank's flat fp32 partitions (which holds them and their moments);
    ``None`` for an engine without an optimizer."""
    optimizer = getattr(engine, "optimizer", None)
    return getattr(optimizer, "optimizer", optimizer)


def _moment_keys(engine) -> list[str]:
    """The optimizer's per-element state (AdamW: exp_avg, exp_avg_sq), from its state after a step."""
    states = [s for s in inner_optimizer(engine).state.values() if s]
    return sorted(k for k, v in states[0].items() if torch.is_tensor(v) and v.dim() > 0) if states else []


def _step(engine) -> torch.Tensor | None:
    states = [s for s in inner_optimizer(engine).state.values() if _STEP in s]
    return torch.as_tensor(states[0][_STEP]).detach().float().cpu() if states else None


def save_optimizer_pieces(engine, piece: Piece, directory: Path, tp_rank: int, pp_rank: int, label: str) -> None:
    """This rank's piece of every trainable parameter's optimizer state, placed like its weights piece, with the
    save's ``label`` (:mod:`~mtk.checkpoint.labels`)."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    model: nn.Module = engine.module
    paths = CheckpointPaths(directory)
    tensors: dict[str, torch.Tensor] = {}
    keys, step = _moment_keys(engine), _step(engine)
    for name, param in checkpointed_parameters(model):
        held = flat_piece(param, piece)
        if not param.requires_grad or held is None:
            continue
        count = held[1][1] - held[1][0]
        for key in keys:  # [ceil(numel / dp)] fp32, zero-padded at the end: this piece's run of it
            tensors[f"{name}::{key}"] = safe_get_local_optimizer_state(param, key)[:count].detach().cpu()
        if param.dtype != torch.float32:  # a bf16 weight's fp32 master is state too
            tensors[f"{name}::{_MASTER}"] = safe_get_local_fp32_param(param)[:count].detach().cpu()
        if step is not None and piece.index == 0:
            tensors[f"{name}::{_STEP}"] = step.clone()  # one tensor per name (safetensors refuses shared ones)
    stem = paths.optimizer(tp_rank, pp_rank, piece=piece.index)
    save_file(tensors, str(stem.with_suffix(".safetensors")), {KEY: label})
    if piece.index == 0:
        groups = [{k: v for k, v in group.items() if k != "params"} for group in inner_optimizer(engine).param_groups]
        record = {"param_groups": groups, "state": {}, "engine": "deepspeed", KEY: label}
        paths.optimizer(tp_rank, pp_rank).with_suffix(".json").write_text(json.dumps(record, default=float))


def _partition(shard: torch.Tensor, param) -> torch.Tensor:
    """This rank's ZeRO-3 partition of a whole TP shard: ``ceil(numel / dp)`` elements, zero-padded at the end."""
    import torch.distributed as dist

    size = param.ds_tensor.numel()
    start = dist.get_rank(group=param.ds_process_group) * size
    flat = shard.reshape(-1)[start : start + size]  # [<= size]
    return torch.nn.functional.pad(flat, (0, size - flat.numel()))


def load_at_another_layout(directory: str | Path, engine, meta: CheckpointMeta, parallel: ParallelState) -> None:
    """Set the ZeRO-3 engine's parameters, fp32 masters and optimizer state from an mtk checkpoint of another
    layout (collective only through DeepSpeed's own calls; every rank reads what it needs)."""
    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

    model: nn.Module = engine.module
    paths = CheckpointPaths(directory)
    groups_file = paths.optimizer(0, 0).with_suffix(".json")
    if meta.base_model is not None or not groups_file.is_file():
        why = (
            "a LoRA run under ZeRO-3 saves its optimizer state as DeepSpeed's only"
            if meta.base_model is not None
            else "it holds no optimizer state in mtk's format (written by an older mtk, or with MiCS)"
        )
        raise CheckpointError(
            f"{directory} resumes at its own layout only ({why}); take its weights with `mtk export`"
        )
    inner = inner_optimizer(engine)
    if not type(inner).__module__.startswith("torch.optim"):  # DeepSpeed's own Adams keep other state types
        raise CheckpointError(
            f"resuming {directory} at another layout needs torch's optimizer inside DeepSpeed (mtk's default, "
            f'"torch_adam": true), not {type(inner).__name__}; resume at the checkpoint\'s layout'
        )
    if engine.fp16_enabled():  # the loss scale is DeepSpeed's own state: it would start over and skip steps
        raise CheckpointError(
            f"resuming {directory} at another layout with fp16 loss scaling is not supported (the scale would "
            "start over); resume at the checkpoint's layout, or train in bf16"
        )
    with reading(groups_file):
        saved_groups = jsonio.read(groups_file)["param_groups"]
        rates = [float(group["lr"]) for group in saved_groups]
    if len(saved_groups) != len(inner.param_groups):
        raise CheckpointError(
            f"{directory}: DeepSpeed's optimizer had {len(saved_groups)} parameter groups there and "
            f"{len(inner.param_groups)} here; resume at the checkpoint's layout"
        )
    with ShardedCheckpointReader(directory, meta) as reader:
        fields: dict[str, list[str]] = {}
        for key in reader.optimizer_keys():
            name, _, field = key.rpartition("::")
            fields.setdefault(name, []).append(field)
        moments = sorted({f for names in fields.values() for f in names} - {_MASTER, _STEP})
        step = next((reader.full_optimizer_state(f"{n}::{_STEP}") for n, fs in fields.items() if _STEP in fs), None)
        _create_state(engine, moments, step)
        available = set(reader.shards)
        for name, param in checkpointed_parameters(model):
            param = cast(Any, param)  # a ZeRO-3 parameter: its partition is ds_tensor
            shape, spec = full_shape_and_spec(model, name)
            source = source_name(model, name, available)
            weights = take_shard(spec, shape, reader.full(source).__getitem__)
            param.ds_tensor.data.copy_(_partition(weights, param))
            if not param.requires_grad:
                continue
            for field in moments + [_MASTER]:
                if field not in fields.get(source, []):
                    if field == _MASTER:  # an fp32 run's weights are their own master
                        safe_set_local_fp32_param(param, _partition(weights.float(), param))
                        continue
                    raise CheckpointError(f"{directory}: no optimizer state {source}::{field}")
                full = reader.full_optimizer_state(f"{source}::{field}")
                value = _partition(take_shard(spec, shape, full.__getitem__).float(), param)
                if field == _MASTER:
                    safe_set_local_fp32_param(param, value)
                else:
                    safe_set_local_optimizer_state(param, value, field)
        load_buffers(model, reader)
    for group, rate in zip(inner.param_groups, rates):
        group["lr"] = rate  # the scheduler sets it from here on
    engine.global_steps = meta.step
    engine.global_samples = meta.step * engine.train_batch_size()
    engine.micro_steps = meta.step * engine.gradient_accumulation_steps()


def _create_state(engine, moments: list[str], step: torch.Tensor | None) -> None:
    """A fresh engine's optimizer has no state until its first step (torch creates it lazily, for the flat fp32
    partitions ZeRO-3 hands it only during the step): the moments are made here, zero, to be overwritten piece by
    piece, with the checkpoint's step count."""
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if flats is None:
        raise CheckpointError(
            "this DeepSpeed version keeps ZeRO-3's fp32 partitions elsewhere (no fp32_partitioned_groups_flat); "
            "resume at the checkpoint's own layout"
        )
    inner = inner_optimizer(engine)
    for flat in flats:  # [this rank's elements of one sub-group], fp32
        state: dict[str, Any] = inner.state[flat]
        for key in moments:
            state.setdefault(key, torch.zeros_like(flat))
        if step is not None:
            state["step"] = step.clone().reshape(()).to(torch.float32)
