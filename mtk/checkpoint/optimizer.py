"""Optimizer state in a checkpoint, keyed by HF parameter name so it can be resharded like the weights.

Tensors (``exp_avg``, ``exp_avg_sq``, ...) go to safetensors as ``"<param name>::<state key>"``; param
groups and non-tensor state to JSON. Moments are cut with their parameter's ShardSpec.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from mtk import jsonio
from mtk.checkpoint.labels import KEY
from mtk.checkpoint.optimizer_checks import check_loadable, report_changed_settings
from mtk.checkpoint.paths import CheckpointPaths, reading
from mtk.checkpoint.weights import own_part, own_rows, read_safetensors, source_name
from mtk.errors import CheckpointError
from mtk.parallel.expert_parallel import experts_piece, spread_layout, whole_piece
from mtk.parallel.fsdp import shard_like
from mtk.parallel.gather import full_shape_and_spec
from mtk.parallel.pieces import Piece, flat_piece
from mtk.parallel.sharding import take_shard

OWN_FILE = "mtk_file"  # header and JSON key: the stem a rank's optimizer file was written as

__all__ = [
    "check_listed_parameters",
    "check_settings_agree",
    "load_optimizer",
    "reshard_optimizer",
    "save_optimizer",
    "saved_optimizer_groups",
]


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


def save_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    stem: Path,
    piece: Piece | None = None,
    *,
    groups: Path,
    label: str | None = None,
) -> None:
    """Moments as whole TP shards, like the weights; with ``piece`` (FSDP2, ZeRO-3, EP), this rank's flat piece of
    each (a moment is split as its parameter is, so the weights file's ranges place it). Param groups and non-tensor
    state go to ``groups`` (JSON), written with piece 0 only. Both keep the save's ``label``
    (:mod:`~mtk.checkpoint.labels`)."""
    names = _param_names(model, optimizer)
    state_dict = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    other: dict[str, dict[str, Any]] = {}
    for index, param_state in sorted(state_dict["state"].items()):  # model order on every rank (collectives below)
        layout = spread_layout(model, names[index]) if piece is not None else None
        for key, value in param_state.items():
            if not torch.is_tensor(value):
                other.setdefault(names[index], {})[key] = value
            elif piece is None:
                tensors[f"{names[index]}::{key}"] = value.detach().contiguous().cpu()
            elif value.dim() == 0:  # a scalar (Adam's step): piece 0 keeps it as it is
                if piece.index == 0:
                    tensors[f"{names[index]}::{key}"] = value.detach().cpu()
            elif layout is not None:  # a moment of this EP rank's experts: placed by the weights file's range
                if piece.experts:  # (another rank holding the same experts saves them otherwise)
                    run = experts_piece(value, layout) or whole_piece(value, layout)  # (whole: collective over EP)
                    if run is not None:
                        tensors[f"{names[index]}::{key}"] = run[0].contiguous().cpu()
            elif (held := flat_piece(value, piece)) is not None:
                tensors[f"{names[index]}::{key}"] = held[0].cpu()  # [stop - start]
    marks = {KEY: label} if label else {}
    if piece is None:  # one file per TP x PP rank, whose tensors' shapes are every TP rank's: it names its own place
        marks[OWN_FILE] = stem.name
    save_file(tensors, str(stem.with_suffix(".safetensors")), metadata=marks or None)
    if piece is None or piece.index == 0:
        param_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
            for g in state_dict["param_groups"]
        ]
        groups.write_text(json.dumps({"param_groups": param_groups, "state": other, **marks}))


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, stem: Path) -> None:
    with reading(stem.with_suffix(".json")):
        _load_optimizer(model, optimizer, stem)


def _load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, stem: Path) -> None:
    names = _param_names(model, optimizer)
    tensors = read_safetensors(stem.with_suffix(".safetensors"))
    meta = jsonio.read(stem.with_suffix(".json"))
    _check_own_file(stem.with_suffix(".safetensors"), _header(stem.with_suffix(".safetensors")).get(OWN_FILE), stem)
    _check_own_file(stem.with_suffix(".json"), meta.get(OWN_FILE) if isinstance(meta, dict) else None, stem)
    index = {name: i for i, name in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        name, _, field = key.rpartition("::")
        if name not in index:
            raise CheckpointError(f"{stem}: optimizer state for unknown parameter {name!r}")
        state.setdefault(index[name], {})[field] = value
    if not isinstance(meta["state"], dict):
        raise TypeError("state is not an object of parameter names")
    for name, fields in meta["state"].items():
        if name not in index:
            raise CheckpointError(f"{stem}: optimizer state for unknown parameter {name!r}")
        state.setdefault(index[name], {}).update(fields)
    _check_grouping(stem, meta["param_groups"], optimizer, names)
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in meta["param_groups"]]
    _load_as_params_are_split(optimizer, names, state, groups)


def _header(path: Path) -> dict[str, str]:
    try:
        with safe_open(str(path), "pt") as handle:
            return handle.metadata() or {}
    except Exception as err:  # safetensors raises its own types
        raise CheckpointError(f"{path} is not a readable safetensors file ({err})") from None


def _check_own_file(path: Path, named: Any, stem: Path) -> None:
    """A rank's optimizer file names the place it was written for (files of every TP rank hold tensors of the same
    shapes: swapped or copied over, they loaded another rank's moments without a word); older files name none."""
    if named is not None and named != stem.name:
        raise CheckpointError(
            f"{path} was written as {named!r}, not {stem.name!r}: another rank's file (swapped or copied over) or "
            "damaged; use the checkpoint as it was saved"
        )


def _check_grouping(stem: Path, saved: list[dict], optimizer: torch.optim.Optimizer, names: list[str]) -> None:
    """The saved groups list this optimizer's parameters, each once, grouped and ordered as this run's optimizer
    groups them (torch's ``load_state_dict`` pairs them by position: a list in another order paired moments with
    parameters of another shape, a traceback at the first step)."""
    shaped = isinstance(saved, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved)
    if not shaped:
        raise TypeError("param_groups is not a list of objects, each with its list of params")
    listed = [[str(n) for n in group["params"]] for group in saved]
    mine, start = [], 0
    for group in optimizer.param_groups:
        mine.append(names[start : start + len(group["params"])])
        start += len(group["params"])
    if listed != mine:
        first = next(
            (f"{a!r} where this run has {b!r}" for a, b in zip(sum(listed, []), names) if a != b),
            f"{sum(map(len, listed))} parameters in {len(listed)} groups, this run {len(names)} in {len(mine)}",
        )
        raise CheckpointError(
            f"{stem.with_suffix('.json')} lists the optimizer's parameters otherwise than this run's optimizer holds "
            f"them ({first}); resume with the same parameter groups, or use another checkpoint"
        )


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


def _load_as_params_are_split(
    optimizer: torch.optim.Optimizer, names: list[str], state: dict[int, dict[str, Any]], groups: list[dict]
) -> None:
    """``optimizer.load_state_dict`` once its content is checked, each moment (a whole TP shard) cut as its parameter
    is cut over DP."""
    check_loadable(optimizer, names, state, groups)
    report_changed_settings(optimizer, groups)
    params = _params(optimizer)
    for index, fields in state.items():
        for key, value in fields.items():
            if torch.is_tensor(value) and value.dim() > 0:
                fields[key] = shard_like(value, params[index])
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def reshard_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, reader, saved_groups: dict) -> None:
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
        source = source_name(model, name, fields)
        rows = own_rows(model, name)  # this EP rank's experts' moments, read alone
        layout = spread_layout(model, name)
        for field in fields.get(source, ()):
            full = reader.full_optimizer_state(f"{source}::{field}", rows=rows)
            if full.dim() == 0:
                value = full
            else:
                full = own_part(model, name, full, rows)
                shape, spec = full_shape_and_spec(model, name)
                if layout is not None:
                    shape = layout.own_shape(tuple(shape))
                # contiguous, as the parameter is: a fused optimizer reads its state by memory, not by index
                value = take_shard(spec, shape, full.__getitem__).contiguous()
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
    _load_as_params_are_split(optimizer, names, state, groups)


def check_settings_agree(paths: CheckpointPaths, tp_size: int, pp_size: int, optimizers: int = 1) -> None:
    """Every TP rank's file of a stage holds the same parameter-group settings (learning rate, weight decay, betas,
    ...): each TP rank of a replica steps with its own file's at the layout that wrote them, so one rank's file from
    another save (or edited) trained its shards with other settings than the others', without a word."""
    if tp_size == 1:
        return
    for index in range(optimizers):
        for stage in range(pp_size):
            settings = []
            for tp in range(tp_size):
                path = paths.optimizer(tp, stage, index).with_suffix(".json")
                with reading(path):
                    groups = jsonio.read(path)["param_groups"]
                    if not isinstance(groups, list) or not all(isinstance(group, dict) for group in groups):
                        raise TypeError("param_groups is not a list of objects")
                    settings.append([{k: v for k, v in group.items() if k != "params"} for group in groups])
            for tp, theirs in enumerate(settings[1:], start=1):
                if theirs != settings[0]:
                    raise CheckpointError(
                        f"{paths.root}: the optimizer settings of TP rank {tp}'s file differ from TP rank 0's (stage "
                        f"{stage}); the files are not from one save (crafted, or mixed from two runs): use another "
                        "checkpoint"
                    )


def check_listed_parameters(paths: CheckpointPaths, names: list[str], held: dict[str, set[str]]) -> None:
    """What ``mtk verify-checkpoint`` checks of each optimizer JSON (``names``, relative to the checkpoint) without
    the run: its groups list parameter names, each once, and each a tensor its rank's weights file holds (``held``:
    the names of each ``tpXX-ppYY`` rank's weights). A resume refuses a list of another order too, against the
    run's optimizer; a checkpoint alone does not know that order."""
    for name in names:
        path = paths.root / name
        with reading(path):
            record = jsonio.read(path)
            groups = record["param_groups"]
            if not isinstance(groups, list) or not all(isinstance(group, dict) for group in groups):
                raise TypeError("param_groups is not a list of objects")
        if record.get("engine") == "deepspeed":  # DeepSpeed's groups name no parameters (its own files hold them)
            continue
        listed = [n for group in groups for n in (group.get("params") or [])]
        rank = Path(name).stem[: len("tpXX-ppYY")]  # optimizer/tp01-pp00-1.json: optimizer 1 of (tp 1, pp 0)
        weights = held.get(rank, set())
        twice = sorted({n for n in listed if listed.count(n) > 1})
        unknown = [n for n in listed if not isinstance(n, str) or n not in weights]
        if twice or unknown:
            what = f"lists {twice[0]!r} twice" if twice else f"lists {unknown[0]!r}, which model/{rank} does not hold"
            raise CheckpointError(
                f"{path} {what}; not as mtk wrote it (crafted, or mixed from two runs): use another checkpoint"
            )


def saved_optimizer_groups(paths: CheckpointPaths, pp_size: int) -> dict:
    """Param groups and non-tensor state of TP rank 0 of every stage, merged."""
    merged: dict[str, Any] = {"param_groups": None, "state": {}}
    for stage in range(pp_size):
        path = paths.optimizer(0, stage).with_suffix(".json")
        with reading(path):
            meta = jsonio.read(path)
            merged["param_groups"] = merged["param_groups"] or meta["param_groups"]
            merged["state"].update(meta["state"])
    return merged
