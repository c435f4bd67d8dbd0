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

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open

from mtk import jsonio
from mtk.checkpoint.meta import CheckpointMeta
from mtk.checkpoint.optimizer_checks import check_scheduler_started
from mtk.checkpoint.paths import CheckpointPaths, reading
from mtk.errors import CheckpointError

__all__ = [
    "check_engine_state",
    "check_learning_rates",
    "check_optimizer_steps",
    "check_saved_counts",
    "check_scheduler_positions",
    "learning_rates",
    "optimizer_steps",
    "recorded_counts",
    "engine_state_sums",
]


Steps = tuple[int, int] | None  # the fewest and the most steps any parameter's optimizer state counts


def _fewest_and_most(steps: Sequence[int]) -> Steps:
    return (min(steps), max(steps)) if steps else None


NOT_A_COUNT = 2**61  # what a step that is not one count (a tensor of many, a bool) counts as: no save records it


def step_bounds(step: Any) -> tuple[int, int]:
    """The whole counts a ``step`` (a number, or a tensor of them) lies between: a fraction (2.9 steps, crafted: Adam
    corrects its moments by it) is counted as both its floor and its ceiling, so it cannot pass for either; so is a
    step that is not one count (DeepSpeed's files restore what they hold before any check of mtk's sees it)."""
    if torch.is_tensor(step) and (step.numel() != 1 or step.dtype == torch.bool):  # not one count: matches no record
        return -1, NOT_A_COUNT
    values = step.detach().double() if torch.is_tensor(step) else torch.tensor(float(step), dtype=torch.float64)
    return math.floor(float(values.min())), math.ceil(float(values.max()))


def optimizer_steps(optimizers: Sequence[torch.optim.Optimizer], device: torch.device) -> Steps:
    """The fewest and the most steps any parameter's optimizer state counts (its ``step``), over every optimizer
    and every rank; ``None`` when no state keeps a count (SGD, a fresh optimizer, an engine's own). Both, because a
    state of another save may count fewer as well as more. Collective over the world (each rank holds the state of
    its own shard, stage or share)."""
    found = [
        bound
        for optimizer in optimizers
        for fields in (optimizer.state if isinstance(optimizer.state, Mapping) else {}).values()
        if isinstance(fields, Mapping)
        for step in [fields.get("step")]
        if (torch.is_tensor(step) and step.numel()) or (isinstance(step, (int, float)) and not isinstance(step, bool))
        for bound in step_bounds(step)
    ]
    here = _fewest_and_most(found)
    if not dist.is_initialized():
        return here
    # one MAX over (-fewest, most); a rank without state sends the identities
    flag = torch.tensor([-here[0], here[1]] if here else [-(2**62), -1], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return None if int(flag[1]) < 0 else (-int(flag[0]), int(flag[1]))


def _position(scheduler: Any) -> Any:
    """A scheduler's position as it holds it: torch's ``last_epoch``, DeepSpeed's ``last_batch_iteration``."""
    return getattr(scheduler, "last_epoch", getattr(scheduler, "last_batch_iteration", None))


def _comparable(position: Any) -> Any:
    """A position read back, for comparing with the recorded one: a count or ``None`` as it is, anything else (100.0,
    ``tensor(100)``, ``True``) as its text, which equals no recorded position (nor the null of a scheduler that
    keeps none)."""
    if position is None or (isinstance(position, int) and not isinstance(position, bool)):
        return position
    return repr(position)


def scheduler_positions(schedulers: Sequence[Any]) -> list[int | None]:
    """Each scheduler's position, as a save records it: ``None`` for one that keeps none (or none that is a count)."""
    positions: list[int | None] = []
    for scheduler in schedulers:
        position = _position(scheduler)
        positions.append(position if isinstance(position, int) and not isinstance(position, bool) else None)
    return positions


def recorded_counts(
    optimizers: Sequence[torch.optim.Optimizer] | None, schedulers: Sequence[Any], device: torch.device
) -> dict[str, Any]:
    """What the metadata records of the files a save writes. Collective (:func:`optimizer_steps`). ``optimizers``
    ``None``: an engine's own (DeepSpeed's, which counts its steps itself), nothing recorded of them."""
    counts: dict[str, Any] = {"scheduler_positions": scheduler_positions(schedulers)}
    if optimizers is not None:
        steps = optimizer_steps(optimizers, device)
        counts["optimizer_steps"] = steps[1] if steps else None
        counts["fewest_optimizer_steps"] = steps[0] if steps else None
        counts["learning_rates"] = [learning_rates(optimizer.param_groups) for optimizer in optimizers]
    return counts


def _sums(tensors: Sequence[torch.Tensor]) -> list[float]:
    """``[sum, sum of |x|]`` of ``tensors`` in float64."""
    if not tensors:
        return [0.0, 0.0]
    values = [t.detach().to(torch.float64) for t in tensors]
    return [
        float(torch.stack([v.sum() for v in values]).sum()),
        float(torch.stack([v.abs().sum() for v in values]).sum()),
    ]


def _state_sums(optimizer: Any, weights: Sequence[torch.Tensor]) -> list[float]:
    """:func:`_sums` of an optimizer's parameters and state tensors of one or more dimensions (its moments; a count
    kept as a 0-dim tensor or a number is left out: an engine may restore it as the other), then of ``weights``."""
    tensors = [p for group in optimizer.param_groups for p in group["params"]] if optimizer is not None else []
    states = optimizer.state.values() if optimizer is not None else []
    tensors += [t for state in states for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
    return _sums(tensors) + _sums(weights)


def engine_state_sums(optimizer: Any, weights: Sequence[torch.Tensor]) -> list[list[float]]:
    """Every rank's sums of an engine's optimizer (DeepSpeed's inner one: its fp32 partitions and moments) and of
    the ``weights`` its own files restore (DeepSpeed's ZeRO-1/2 module weights), in rank order: what a save records
    of files mtk does not write or label itself. Collective."""
    mine = _state_sums(optimizer, weights)
    if not dist.is_initialized():
        return [mine]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def check_engine_state(
    optimizer: Any, weights: Sequence[torch.Tensor], meta: CheckpointMeta, where: str, device: torch.device
) -> None:
    """The engine's state just restored from its own files holds, on every rank, the sums its save recorded
    (``counts.engine_state``, :func:`engine_state_sums`): its files from another save of the run (checksums
    rewritten) trained on from that save's moments and weights, without a word. A labelled save (one of the code
    that records the sums) must hold them for every rank: removed or cut, the check would be off. Collective: every
    rank refuses together."""
    saved = meta.counts.get("engine_state")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if saved is None and meta.save is None:
        return  # written before the record
    if not isinstance(saved, list) or len(saved) != world:
        count = "no" if saved is None else len(saved)
        raise CheckpointError(
            f"{where}: its metadata records the engine's state sums of {count} ranks, its save had {world}; not as "
            "mtk wrote it (crafted, or damaged): use another checkpoint"
        )
    differs = torch.tensor([1.0 if _state_sums(optimizer, weights) != saved[rank] else 0.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(differs, op=dist.ReduceOp.MAX)
    if differs.item():
        raise CheckpointError(
            f"{where}: the engine's state restored from its own files is not the one its save recorded (weights or "
            "moments of another save); its files are from another save (crafted, or mixed from two runs): use "
            "another checkpoint"
        )


def learning_rates(groups: Sequence[Mapping[str, Any]]) -> list[float]:
    """Each parameter group's learning rate, the schedule's value at the step (a tensor's as a number); one that is
    not a number (``"0.0009"`` in a file) is one line, not a rate that compares equal."""
    rates = []
    for group in groups:
        lr = group["lr"]
        if isinstance(lr, (str, bool)) or not (torch.is_tensor(lr) or isinstance(lr, (int, float))):
            raise CheckpointError(f"a learning rate {lr!r} is not a number: not as mtk saved it (crafted, or damaged)")
        rates.append(float(lr))
    return rates


def check_learning_rates(optimizers: Sequence[torch.optim.Optimizer], recorded: Mapping[str, Any], where: str) -> None:
    """Each optimizer just loaded steps at the learning rates its save recorded: a group's ``lr`` from another save
    (or edited) ran the first resumed step at that rate, whatever the scheduler said, without a word."""
    saved = recorded.get("learning_rates")
    if not isinstance(saved, list):
        return
    if len(saved) != len(optimizers):  # an emptied or cut list would check nothing
        raise CheckpointError(
            f"{where}: its metadata records the learning rates of {len(saved)} optimizers, this run restores "
            f"{len(optimizers)}; not as mtk wrote it (crafted, or damaged): use another checkpoint"
        )
    for number, (optimizer, expected) in enumerate(zip(optimizers, saved)):
        mine = learning_rates(optimizer.param_groups)
        if mine != expected:
            raise CheckpointError(
                f"{where}: optimizer {number}'s learning rates {mine} are not the {expected} its metadata recorded; "
                "the file is from another save (crafted, or mixed from two runs): use another checkpoint"
            )


def check_optimizer_steps(steps: Steps, recorded: Mapping[str, Any], where: str) -> None:
    """The optimizer state just loaded (``steps``, :func:`optimizer_steps`) counts what the metadata recorded: the
    most steps, and the fewest (recorded since the field exists)."""
    for key, index in (("optimizer_steps", 1), ("fewest_optimizer_steps", 0)):
        if key not in recorded:
            continue
        mine, saved = (steps[index] if steps else None), recorded[key]
        if saved != mine:
            which = "counts" if index else "counts at fewest"
            raise CheckpointError(
                f"{where}: the optimizer state {which} {mine} steps where its metadata recorded {saved}; the file is "
                "from another save (crafted, or mixed from two runs): use another checkpoint"
            )


def check_scheduler_positions(schedulers: Sequence[Any], recorded: Mapping[str, Any], where: str) -> None:
    """Each scheduler just loaded is at the position the metadata recorded for it (a checkpoint written before the
    record says nothing)."""
    saved = recorded.get("scheduler_positions")
    if not isinstance(saved, list):
        return
    for number, (scheduler, expected) in enumerate(zip(schedulers, saved)):
        position = _comparable(_position(scheduler))  # as loaded
        if position != expected:  # (``None``: a scheduler that keeps no position, so the file holds none either)
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
    optimizer_files = [name for name in sorted(meta.files) if name.startswith("optimizer/")]
    # an engine's steps without mtk's files of them (DeepSpeed's ZeRO 1/2) are checked when it loads its own
    if "optimizer_steps" in recorded and (meta.engine is None or optimizer_files):
        found: list[int] = []
        for name in optimizer_files:
            if name.endswith(".safetensors"):
                with reading(paths.root / name), safe_open(str(paths.root / name), framework="pt") as file:
                    for key in file.keys():  # noqa: SIM118 (a safetensors file is not a mapping)
                        if key.endswith("::step"):
                            found.extend(step_bounds(file.get_tensor(key)))
            elif name.endswith(".json"):  # steps kept as numbers (Adafactor's)
                with reading(paths.root / name):
                    state = jsonio.read(paths.root / name)["state"]
                    if not isinstance(state, dict):
                        raise TypeError("state is not an object")
                    for fields in state.values():
                        step = fields.get("step") if isinstance(fields, dict) else None
                        if isinstance(step, (int, float)) and not isinstance(step, bool):
                            found.extend(step_bounds(step))
        check_optimizer_steps(_fewest_and_most(found), recorded, str(directory))
    rates = recorded.get("learning_rates") or []
    numbers = set()
    for name in optimizer_files:  # every stage's groups (every TP rank's agree: checked before)
        match = re.fullmatch(r"optimizer/tp00-pp\d+(?:-(\d+))?\.json", name)
        if match is None:
            continue
        number = int(match[1] or 0)
        numbers.add(number)
        with reading(paths.root / name):
            mine = learning_rates(jsonio.read(paths.root / name)["param_groups"])
        expected = rates[number] if number < len(rates) else None
        if "learning_rates" in recorded and mine != expected:
            raise CheckpointError(
                f"{directory}: {name} holds the learning rates {mine}, its metadata recorded {expected}; the "
                "file is from another save (crafted, or mixed from two runs): use another checkpoint"
            )
    if numbers and "learning_rates" in recorded and len(rates) != len(numbers):  # as resume counts them
        raise CheckpointError(
            f"{directory}: its metadata records the learning rates of {len(rates)} optimizers, the checkpoint holds "
            f"{len(numbers)}; not as mtk wrote it (crafted, or damaged): use another checkpoint"
        )
    for number, expected in enumerate(recorded.get("scheduler_positions") or []):
        path = paths.scheduler(number)
        if str(path.relative_to(paths.root)) not in meta.files:
            raise CheckpointError(
                f"{directory}: its metadata records {len(recorded['scheduler_positions'])} schedulers, the checkpoint "
                f"holds no {path.name}; not as mtk wrote it (crafted, or damaged): use another checkpoint"
            )
        with reading(path):
            state = torch.load(path, weights_only=True)
        position = state.get("last_epoch", state.get("last_batch_iteration")) if isinstance(state, dict) else None
        position = _comparable(position)
        if position != expected:
            raise CheckpointError(
                f"{directory}: {path.name} is at position {position} where the metadata recorded {expected}; the file "
                "is from another save (crafted, or mixed from two runs): use another checkpoint"
            )
    _check_scheduler_started(paths, meta)


def _check_scheduler_started(paths: CheckpointPaths, meta: CheckpointMeta) -> None:
    """verify's half of resume's check that the scheduler's ``base_lrs`` are its optimizer's ``initial_lr``s
    (:func:`~mtk.checkpoint.optimizer_checks.check_scheduler_started`), where the pairing is sure without the run's
    objects: one optimizer (stage 0's groups: rank 0 saved the scheduler) and one scheduler."""
    schedulers = [name for name in meta.files if re.fullmatch(r"scheduler(_\d+)?\.pt", name)]
    groups_files = [name for name in meta.files if re.fullmatch(r"optimizer/tp00-pp00(-\d+)?\.json", name)]
    if schedulers != ["scheduler.pt"] or groups_files != ["optimizer/tp00-pp00.json"]:
        return
    scheduler, groups = paths.scheduler(0), paths.root / groups_files[0]
    with reading(groups):
        param_groups = jsonio.read(groups)["param_groups"]
    if not (isinstance(param_groups, list) and all(isinstance(group, dict) for group in param_groups)):
        return  # (its shape is the optimizer checks' to name)
    with reading(scheduler):  # named as resume names it
        saved = torch.load(scheduler, weights_only=True)
        if isinstance(saved, dict):
            check_scheduler_started(saved, param_groups)
