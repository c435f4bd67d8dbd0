"""Training checkpoints: ``ckpts/step_N/`` with one shard per (tp, pp) rank, split by concern.

::

    step_N/
      metadata.json                   topology, versions, data position; written last = "complete"
      model/tp00-pp00.safetensors     this (tp, pp) rank's parameter shards (+ each one's ShardSpec)
      optimizer/tp00-pp00.safetensors optimizer tensors keyed "<param name>::<state key>"
      optimizer/tp00-pp00.json        param groups (by parameter name) and non-tensor state
      scheduler.pt                    LR scheduler state (replicated)
      rng/rank00000.pt                every rank's RNG states (python, numpy, torch, device, TP stream)

Weights and optimizer state are keyed by HF parameter names and carry their shard specs, so a
checkpoint can be merged (export) or re-split at another layout. Everything is written into
``step_N.incomplete`` and renamed when every rank has finished: an interrupted save never looks
like a checkpoint. Files are read back only as safetensors, JSON, or ``torch.load(weights_only=True)``.
Several nodes must share the checkpoint filesystem.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from mtk.checkpoint.hf_load import CheckpointError
from mtk.checkpoint.reshard import ShardedCheckpointReader
from mtk.convert import parallelized
from mtk.parallel.gather import full_shape_and_spec
from mtk.parallel.parameters import param_info
from mtk.parallel.sharding import take_shard
from mtk.parallel.state import ParallelState

__all__ = ["FORMAT", "load_checkpoint", "read_metadata", "restore_rng", "save_checkpoint"]

FORMAT = "mtk-checkpoint/1"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _shard_name(state: ParallelState) -> str:
    return f"tp{state.tp_rank:02d}-pp{state.pp_rank:02d}"


def _versions() -> dict[str, str]:
    import accelerate
    import transformers

    import mtk

    return {
        "mtk": mtk.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
    }


# --------------------------------------------------------------------------------------- weights
def _save_weights(model: nn.Module, path: Path) -> None:
    tensors, specs = {}, {}
    for name, param in model.named_parameters():
        full_shape, spec = full_shape_and_spec(model, name)
        tensors[name] = param.detach().contiguous().cpu()
        specs[name] = {
            "full_shape": list(full_shape),
            "dim": spec.dim,
            "ranges": [list(r) for r in spec.ranges],
            "local_size": spec.local_size,
        }
        if param_info(param).pipeline_duplicate:  # last stage's copy of a tied embedding
            specs[name]["tied_to"] = param_info(param).tied_to
    save_file(tensors, str(path), metadata={"mtk_specs": json.dumps(specs)})


def _load_weights(model: nn.Module, path: Path) -> None:
    tensors = _read_safetensors(path)
    params = dict(model.named_parameters())
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise CheckpointError(f"{path} does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        for name, param in params.items():
            if tensors[name].shape != param.shape:
                raise CheckpointError(
                    f"{path}: {name} has shape {tuple(tensors[name].shape)}, model has {tuple(param.shape)}"
                )
            param.copy_(tensors[name])


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        return load_file(str(path))
    except Exception as err:  # safetensors raises its own types for corrupt files
        raise CheckpointError(f"{path} is not a readable safetensors file ({err})") from None


# ------------------------------------------------------------------------------------- optimizer
def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the optimizer's parameters in its own index order."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    names = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in by_id:
                raise CheckpointError("the optimizer holds a parameter that is not part of the model")
            names.append(by_id[id(param)])
    return names


def _save_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, stem: Path) -> None:
    names = _param_names(model, optimizer)
    state_dict = optimizer.state_dict()
    tensors, other = {}, {}
    for index, param_state in state_dict["state"].items():
        for key, value in param_state.items():
            if torch.is_tensor(value):
                tensors[f"{names[index]}::{key}"] = value.detach().contiguous().cpu()
            else:
                other.setdefault(names[index], {})[key] = value
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
        for g in state_dict["param_groups"]
    ]
    save_file(tensors, str(stem.with_suffix(".safetensors")))
    stem.with_suffix(".json").write_text(json.dumps({"param_groups": groups, "state": other}))


def _load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, stem: Path) -> None:
    names = _param_names(model, optimizer)
    tensors = _read_safetensors(stem.with_suffix(".safetensors"))
    meta = json.loads(stem.with_suffix(".json").read_text())
    index = {name: i for i, name in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        name, _, field = key.rpartition("::")
        if name not in index:
            raise CheckpointError(f"{stem}: optimizer state for unknown parameter {name!r}")
        state.setdefault(index[name], {})[field] = value
    for name, fields in meta["state"].items():
        state.setdefault(index[name], {}).update(fields)
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in meta["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ------------------------------------------------------------------------------------------- RNG
def _rng_state(extra: dict[str, Any]) -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.copy()), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
        **extra,
    }
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if accelerator is not None:
        states["device"] = torch.get_device_module(accelerator.type).get_rng_state_all()
    return states


def _set_rng_state(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(states["torch"])
    if "device" in states:
        accelerator = torch.accelerator.current_accelerator()
        torch.get_device_module(accelerator.type).set_rng_state_all(states["device"])


# ----------------------------------------------------------------------------------- public API
def read_metadata(directory: str | Path) -> dict[str, Any]:
    """The metadata of a complete checkpoint; a clear error for anything else."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    meta_path = directory / "metadata.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{directory} is not a complete mtk checkpoint (no metadata.json; an interrupted save?)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{directory} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def save_checkpoint(
    directory: str | Path,
    state: ParallelState,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    schedulers: list,
    *,
    step: int,
    extra_rng: dict[str, Any] | None = None,
    extra_meta: dict[str, Any] | None = None,
    writers: list[Callable[[Path], None]] = (),
    collective_writers: list[Callable[[Path], None]] = (),
) -> Path:
    """Write a checkpoint at ``directory`` atomically. Collective: every rank calls it.

    ``writers`` run on rank 0 with the (still incomplete) directory, e.g. to save a tokenizer;
    ``collective_writers`` run on every rank (e.g. DeepSpeed's own, collective, save_checkpoint).
    """
    final = Path(directory)
    tmp = final.with_name(final.name + ".incomplete")
    if state.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
        for sub in ("model", "optimizer", "rng"):
            (tmp / sub).mkdir(parents=True)
    _barrier()
    shard = _shard_name(state)
    if state.dp_rank == 0:  # weights and optimizer are replicated over DP: one copy per (tp, pp)
        _save_weights(model, tmp / "model" / f"{shard}.safetensors")
        for i, optimizer in enumerate(optimizers):
            _save_optimizer(model, optimizer, tmp / "optimizer" / (shard if i == 0 else f"{shard}-{i}"))
    for write in collective_writers:
        write(tmp)
    torch.save(_rng_state(extra_rng or {}), tmp / "rng" / f"rank{state.rank:05d}.pt")
    if state.rank == 0:
        for write in writers:
            write(tmp)
        for i, scheduler in enumerate(schedulers):
            torch.save(scheduler.state_dict(), tmp / ("scheduler.pt" if i == 0 else f"scheduler_{i}.pt"))
    _barrier()
    if state.rank == 0:
        meta = {
            "format": FORMAT,
            "step": step,
            "topology": {"world": state.world_size, "tp": state.tp_size, "pp": state.pp_size, "dp": state.dp_size},
            "versions": _versions(),
            "model": {
                "class": type(model).__name__,
                "plan": record.plan.name if (record := parallelized(model)) else None,
                "config": model.config.to_dict() if hasattr(model, "config") else None,
            },
            **(extra_meta or {}),
        }
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=1, default=str))
        if final.exists():  # replace an older checkpoint of the same name only once the new one is whole
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
    _barrier()
    return final


def _source_name(model: nn.Module, name: str, available) -> str:
    """The checkpoint's name for ``name``: itself, or for a pipeline's copy of a tied embedding
    restored from a checkpoint that stored only the embedding, the embedding's name."""
    if name in available:
        return name
    return param_info(model.get_parameter(name)).tied_to or name


def _reshard_weights(model: nn.Module, reader) -> None:
    available = set(reader.pieces)
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape, spec = full_shape_and_spec(model, name)
            full = reader.full(_source_name(model, name, available))
            if tuple(full.shape) != tuple(shape):
                raise CheckpointError(f"{name}: checkpoint has shape {tuple(full.shape)}, this model {tuple(shape)}")
            param.copy_(take_shard(spec, shape, full.__getitem__))


def _reshard_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, reader, saved_groups: dict) -> None:
    """Moments are cut exactly like their parameters (same spec); scalars (``step``) are copied.

    Param groups keep this optimizer's own grouping; their hyperparameters come from the checkpoint
    by position (the same script builds the same groups at any layout).
    """
    names = _param_names(model, optimizer)
    fields: dict[str, list[str]] = {}
    for key in reader.optimizer_keys():
        name, _, field = key.rpartition("::")
        fields.setdefault(name, []).append(field)
    state: dict[int, dict[str, Any]] = {}
    for i, name in enumerate(names):
        source = _source_name(model, name, fields)
        for field in fields.get(source, ()):
            full = reader.full_optimizer_state(f"{source}::{field}")
            if full.dim() == 0:
                value = full
            else:
                shape, spec = full_shape_and_spec(model, name)
                value = take_shard(spec, shape, full.__getitem__)
            state.setdefault(i, {})[field] = value
        if source in saved_groups["state"]:  # non-tensor per-parameter state
            state.setdefault(i, {}).update(saved_groups["state"][source])
    if len(saved_groups["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(saved_groups['param_groups'])} parameter groups, this one "
            f"{len(optimizer.param_groups)}"
        )
    groups, start = [], 0
    for saved, current in zip(saved_groups["param_groups"], optimizer.param_groups):
        count = len(current["params"])
        groups.append({**saved, "params": list(range(start, start + count))})
        start += count
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _saved_optimizer_groups(directory: Path, topology: dict) -> dict:
    """Param groups and non-tensor state of TP rank 0 of every stage, merged."""
    merged: dict[str, Any] = {"param_groups": None, "state": {}}
    for stage in range(topology["pp"]):
        meta = json.loads((directory / "optimizer" / f"tp00-pp{stage:02d}.json").read_text())
        merged["param_groups"] = merged["param_groups"] or meta["param_groups"]
        merged["state"].update(meta["state"])
    return merged


def load_checkpoint(
    directory: str | Path,
    state: ParallelState,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    schedulers: list,
) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and RNG from ``directory``; returns its metadata.

    A checkpoint written at another TP/PP layout is resharded: each tensor (and optimizer moment) is
    merged from the old shards and this rank's new shard cut from it. A changed DP size needs no
    resharding (weights are replicated over DP); RNG states are then taken from rank 0.
    """
    directory = Path(directory)
    meta = read_metadata(directory)
    saved = meta["topology"]
    if (saved["tp"], saved["pp"]) == (state.tp_size, state.pp_size):
        shard = _shard_name(state)
        _load_weights(model, directory / "model" / f"{shard}.safetensors")
        for i, optimizer in enumerate(optimizers):
            _load_optimizer(model, optimizer, directory / "optimizer" / (shard if i == 0 else f"{shard}-{i}"))
    else:
        if len(optimizers) > 1:
            raise CheckpointError("resharding a checkpoint supports one optimizer")
        with ShardedCheckpointReader(directory, saved) as reader:
            _reshard_weights(model, reader)
            for optimizer in optimizers:
                _reshard_optimizer(model, optimizer, reader, _saved_optimizer_groups(directory, saved))
    for i, scheduler in enumerate(schedulers):
        path = directory / ("scheduler.pt" if i == 0 else f"scheduler_{i}.pt")
        scheduler.load_state_dict(torch.load(path, weights_only=True))
    meta["rng"] = restore_rng(directory, meta, state)
    return meta


def restore_rng(directory: str | Path, meta: dict[str, Any], state: ParallelState) -> dict[str, Any]:
    """Set this rank's RNG states from the checkpoint (rank 0's when the world size changed)."""
    same_world = meta["topology"]["world"] == state.world_size
    rng = torch.load(Path(directory) / "rng" / f"rank{state.rank if same_world else 0:05d}.pt", weights_only=True)
    _set_rng_state(rng)
    return rng
