"""The counts a checkpoint's files keep, recorded in its metadata when it is saved and checked when it is loaded.

An optimizer's per-parameter ``step``, a scheduler's position and the data position are each valid alone in a wide
range, so a file taken from another save (another step of the run, another run) or edited and re-checksummed
passed every check of its own and trained on another course without a word: a scheduler at position 100 or 0 in a
checkpoint of step 2 (the learning rate of another step), Adam's bias correction of step 1000, half the data skipped.
The metadata, written by the same save, records what each file counts; at load each file must count the same.
(No bound ties them to the checkpoint's step: a user's own loop that never calls ``accumulate`` steps its optimizer
without counting steps, and a step skipped for a non-finite gradient steps neither optimizer nor scheduler.) A
checkpoint written before the record says nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open

from mtk import jsonio
from mtk.checkpoint.meta import CheckpointMeta
from mtk.checkpoint.paths import CheckpointPaths, reading
from mtk.errors import CheckpointError

__all__ = [
    "check_learning_rates",
    "check_optimizer_steps",
    "check_saved_counts",
    "check_scheduler_positions",
    "learning_rates",
    "optimizer_steps",
    "recorded_counts",
]


def optimizer_steps(optimizers: Sequence[torch.optim.Optimizer], device: torch.device) -> int | None:
    """The most steps any parameter's optimizer state counts (its ``step``), over every optimizer and every rank;
    ``None`` when no state keeps a count (SGD, a fresh optimizer, an engine's own). Collective over the world (each
    rank holds the state of its own shard, stage or share)."""
    most = -1
    for optimizer in optimizers:
        state = optimizer.state if isinstance(optimizer.state, Mapping) else {}
        for fields in state.values():
            step = fields.get("step") if isinstance(fields, Mapping) else None
            if torch.is_tensor(step) and step.numel():
                most = max(most, int(step.detach().max().item()))
            elif isinstance(step, (int, float)) and not isinstance(step, bool):
                most = max(most, int(step))
    if dist.is_initialized():
        flag = torch.tensor([most], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        most = int(flag.item())
    return None if most < 0 else most


def scheduler_positions(schedulers: Sequence[Any]) -> list[int | None]:
    """Each scheduler's position: torch's ``last_epoch``, DeepSpeed's ``last_batch_iteration``; ``None`` for one
    that keeps neither."""
    positions: list[int | None] = []
    for scheduler in schedulers:
        position = getattr(scheduler, "last_epoch", getattr(scheduler, "last_batch_iteration", None))
        positions.append(position if isinstance(position, int) and not isinstance(position, bool) else None)
    return positions


def recorded_counts(
    optimizers: Sequence[torch.optim.Optimizer] | None, schedulers: Sequence[Any], device: torch.device
) -> dict[str, Any]:
    """What the metadata records of the files a save writes. Collective (:func:`optimizer_steps`). ``optimizers``
    ``None``: an engine's own (DeepSpeed's, which counts its steps itself), nothing recorded of them."""
    counts: dict[str, Any] = {"scheduler_positions": scheduler_positions(schedulers)}
    if optimizers is not None:
        counts["optimizer_steps"] = optimizer_steps(optimizers, device)
        counts["learning_rates"] = [learning_rates(optimizer.param_groups) for optimizer in optimizers]
    return counts


def learning_rates(groups: Sequence[Mapping[str, Any]]) -> list[float]:
    """Each parameter group's learning rate, the schedule's value at the step (a tensor's as a number)."""
    return [float(group["lr"]) for group in groups]


def check_learning_rates(optimizers: Sequence[torch.optim.Optimizer], recorded: Mapping[str, Any], where: str) -> None:
    """Each optimizer just loaded steps at the learning rates its save recorded: a group's ``lr`` from another save
    (or edited) ran the first resumed step at that rate, whatever the scheduler said, without a word."""
    saved = recorded.get("learning_rates")
    if not isinstance(saved, list):
        return
    for number, (optimizer, expected) in enumerate(zip(optimizers, saved)):
        mine = learning_rates(optimizer.param_groups)
        if mine != expected:
            raise CheckpointError(
                f"{where}: optimizer {number}'s learning rates {mine} are not the {expected} its metadata recorded; "
                "the file is from another save (crafted, or mixed from two runs): use another checkpoint"
            )


def check_optimizer_steps(steps: int | None, recorded: Mapping[str, Any], where: str) -> None:
    """The optimizer state just loaded (``steps``, :func:`optimizer_steps`) counts what the metadata recorded."""
    if "optimizer_steps" not in recorded:
        return
    saved = recorded["optimizer_steps"]
    if saved != steps:
        raise CheckpointError(
            f"{where}: the optimizer state counts {steps} steps where its metadata recorded {saved}; the file is "
            "from another save (crafted, or mixed from two runs): use another checkpoint"
        )


def check_scheduler_positions(schedulers: Sequence[Any], recorded: Mapping[str, Any], where: str) -> None:
    """Each scheduler just loaded is at the position the metadata recorded for it (a checkpoint written before the
    record says nothing)."""
    saved = recorded.get("scheduler_positions")
    if not isinstance(saved, list):
        return
    for number, (position, expected) in enumerate(zip(scheduler_positions(schedulers), saved)):
        if expected is not None and position != expected:
            raise CheckpointError(
                f"{where}: scheduler {number} is at position {position} where the metadata recorded {expected} (the "
                "learning rate of another step); the file is from another save (crafted, or mixed from two runs): "
                "use another checkpoint"
            )


def check_saved_counts(directory: str | Path, meta: CheckpointMeta) -> None:
    """What ``mtk verify-checkpoint`` checks of the counts without training: the steps the optimizer files hold and
    each scheduler file's position are the ones the metadata recorded (the files' checksums already matched)."""
    recorded = meta.counts
    paths = CheckpointPaths(directory)
    if "optimizer_steps" in recorded:
        most = -1
        for name in sorted(meta.files):
            if name.startswith("optimizer/") and name.endswith(".safetensors"):
                with reading(paths.root / name), safe_open(str(paths.root / name), framework="pt") as file:
                    for key in file.keys():  # noqa: SIM118 (a safetensors file is not a mapping)
                        if key.endswith("::step"):
                            most = max(most, int(file.get_tensor(key).max().item()))
            elif name.startswith("optimizer/") and name.endswith(".json"):  # steps kept as numbers (Adafactor's)
                with reading(paths.root / name):
                    for fields in jsonio.loads((paths.root / name).read_text())["state"].values():
                        step = fields.get("step") if isinstance(fields, dict) else None
                        if isinstance(step, (int, float)) and not isinstance(step, bool):
                            most = max(most, int(step))
        check_optimizer_steps(None if most < 0 else most, recorded, str(directory))
    for number, expected in enumerate(recorded.get("learning_rates") or []):
        path = paths.optimizer(0, 0, number).with_suffix(".json")  # (every TP rank's settings agree: checked)
        with reading(path):
            mine = learning_rates(jsonio.loads(path.read_text())["param_groups"])
        if mine != expected:
            raise CheckpointError(
                f"{directory}: {path.name} holds the learning rates {mine}, its metadata recorded {expected}; the "
                "file is from another save (crafted, or mixed from two runs): use another checkpoint"
            )
    for number, expected in enumerate(recorded.get("scheduler_positions") or []):
        path = paths.scheduler(number)
        with reading(path):
            state = torch.load(path, weights_only=True)
        position = state.get("last_epoch", state.get("last_batch_iteration")) if isinstance(state, dict) else None
        if expected is not None and position != expected:
            raise CheckpointError(
                f"{directory}: {path.name} is at position {position} where the metadata recorded {expected}; the file "
                "is from another save (crafted, or mixed from two runs): use another checkpoint"
            )
