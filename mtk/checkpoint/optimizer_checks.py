"""What a resumed optimizer takes from a checkpoint, checked before it is loaded.

``optimizer.load_state_dict`` accepts any numbers: settings its constructor would refuse (``betas`` of 1, a NaN
weight decay, an ``eps`` that is a string), moments of another shape, NaN steps. Each failed only at the first step,
as a traceback or as NaN weights. Checksums prove a file is the one recorded, not that mtk wrote it (a crafted file
carries its own). A setting that differs from this run's, legitimately saved, wins as in accelerate's
``load_state``; it is said, not dropped.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.distributed as dist

from mtk.errors import CheckpointError
from mtk.parallel.optimizer_updates import ELEMENTWISE

__all__ = ["check_loadable", "check_scheduler_started", "check_scheduler_state", "report_changed_settings"]

_SCHEDULED = ("params", "lr", "initial_lr")  # moved by the schedule, or not settings


def check_loadable(
    optimizer: torch.optim.Optimizer, names: list[str], state: dict[int, dict[str, Any]], groups: list[dict]
) -> None:
    """Refuse (one line) state that is not finite, a negative step count, moments not shaped like their parameter
    (an optimizer that keeps one per element), group settings the optimizer's own constructor refuses, and state
    those settings keep that the file lacks: each group's settings run one step on a probe parameter, whose state
    names what every parameter of the group that has state must hold."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    elementwise = type(optimizer) in ELEMENTWISE
    for index, fields in state.items():
        for key, value in fields.items():
            if not torch.is_tensor(value):
                continue
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise CheckpointError(
                    f"the optimizer's {key!r} of {names[index]} holds NaN or infinity; use another checkpoint"
                )
            if key == "step" and (value.numel() != 1 or value.dtype == torch.bool):  # one count, as torch keeps it
                raise CheckpointError(
                    f"the optimizer's step of {names[index]} is not one count (shape {tuple(value.shape)}, "
                    f"{value.dtype}); use another checkpoint"
                )
            if key == "step" and bool((value < 0).any()):  # a count of steps (Adam's bias correction reads it)
                raise CheckpointError(f"the optimizer's step of {names[index]} is negative; use another checkpoint")
            if elementwise and value.dim() > 0 and tuple(value.shape) != tuple(params[index].shape):
                raise CheckpointError(
                    f"the optimizer's {key!r} of {names[index]} has shape {tuple(value.shape)}, the parameter "
                    f"{tuple(params[index].shape)}; use another checkpoint"
                )
    if not elementwise:
        return
    accepted = inspect.signature(type(optimizer).__init__).parameters
    device = params[0].device if params else torch.device("cpu")  # (fused and capturable depend on it)
    for group in groups:
        settings = {key: value for key, value in group.items() if key in accepted and key != "params"}
        probe = torch.zeros(1, device=device, requires_grad=True)
        try:
            stepped = type(optimizer)([probe], **settings)
            probe.grad = torch.zeros_like(probe)
            stepped.step()  # the state these settings keep per parameter (amsgrad's max_exp_avg_sq, ...)
        except (ValueError, TypeError, RuntimeError) as err:
            raise CheckpointError(
                f"the optimizer settings saved in the checkpoint are ones {type(optimizer).__name__} refuses "
                f"({str(err).strip().splitlines()[0]}); use another checkpoint"
            ) from None
        kept = set(stepped.state[probe])
        for index in group["params"]:
            missing = sorted(kept - set(state.get(index, kept)))
            if missing:
                raise CheckpointError(
                    f"the optimizer state of {names[index]} lacks {missing[0]!r}, which {type(optimizer).__name__} "
                    "keeps with the settings saved beside it; use another checkpoint"
                )


def report_changed_settings(optimizer: torch.optim.Optimizer, groups: list[dict]) -> None:
    """Say (rank 0) each setting of a parameter group that the checkpoint restores over another value this run set
    (``weight_decay``, ``betas``, ...; the learning rate is the schedule's, see the scheduler's own check)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    for number, (saved, current) in enumerate(zip(groups, optimizer.param_groups)):
        for key in sorted(set(saved) & set(current) - set(_SCHEDULED)):
            mine, theirs = _plain(current[key]), _plain(saved[key])
            if mine != theirs:
                group = f" (parameter group {number})" if len(groups) > 1 else ""
                print(
                    f"mtk: the checkpoint's optimizer {key}={theirs} is restored over this run's {mine}{group}, as "
                    "accelerate's load_state does; start a new run to train with another",
                    flush=True,
                )


def _plain(value: Any) -> Any:
    """A setting as JSON keeps it (tuples as lists), for comparison and display."""
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    return value.item() if torch.is_tensor(value) and value.numel() == 1 else value


def check_scheduler_state(current: dict[str, Any], saved: Any, optimizer: Any = None) -> None:
    """A scheduler's saved state shaped as this run's scheduler keeps it: a list per parameter group of the same
    length (two ``base_lrs`` for one group failed at the first step), of finite numbers >= 0, and counts >= 0 (a
    ``last_epoch`` of -7 made the learning rate negative); its ``base_lrs`` those its ``optimizer``, just restored
    from the same save, started from (each group's ``initial_lr``, which a scheduler sets them from). Its learning
    rates, when they differ from this run's, are restored as accelerate's ``load_state`` restores them, and said
    (rank 0)."""
    if not isinstance(saved, dict):
        raise ValueError(f"a scheduler state is a dict, this is a {type(saved).__name__}")
    for key, mine in current.items():
        if key not in saved or not isinstance(mine, list):
            continue
        theirs = saved[key]
        if not isinstance(theirs, list) or len(theirs) != len(mine):
            raise ValueError(f"{key!r} holds {_count(theirs)}, this run's scheduler {len(mine)} (one per group)")
        if any(isinstance(v, float) and not math.isfinite(v) for v in theirs):
            raise ValueError(f"{key!r} holds a NaN or infinite value")
        if any(isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0 for v in theirs):
            raise ValueError(f"{key!r} holds a negative value")  # learning rates, momenta: an ascent, unsaid
    for key, mine in current.items():  # counts (last_epoch, _step_count): a negative one scales the schedule by it
        theirs = saved.get(key)
        if isinstance(mine, int) and isinstance(theirs, int) and not isinstance(theirs, bool) and theirs < 0:
            raise ValueError(f"{key!r} is {theirs}; a count of steps is not negative")
    check_scheduler_started(saved, getattr(optimizer, "param_groups", None) or [])
    if saved.get("base_lrs") != current.get("base_lrs") and (not dist.is_initialized() or dist.get_rank() == 0):
        print(
            f"mtk: the checkpoint's learning rate {saved.get('base_lrs')} is restored over this run's "
            f"{current.get('base_lrs')}, as accelerate's load_state does; start a new run to train with another",
            flush=True,
        )


def check_scheduler_started(saved: dict[str, Any], groups: list[dict[str, Any]]) -> None:
    """A scheduler's ``base_lrs`` are the ``initial_lr`` of its optimizer's ``groups`` (a scheduler sets them from
    each other when it is built, and both are saved together); ``ValueError`` otherwise, also where the groups lack an
    ``initial_lr`` beside a scheduler's ``base_lrs`` for each of them (a scheduler built on the optimizer sets every
    one: removed, the comparison would be off). Groups the scheduler has no rate for (added after it) are not
    compared."""
    started = [float(group["initial_lr"]) if "initial_lr" in group else None for group in groups]
    base = saved.get("base_lrs")
    if isinstance(base, list) and len(base) == len(started) and base != started:
        raise ValueError(
            f"its base learning rates {base} are not the {started} its optimizer's saved groups started from; the "
            "file is from another save (crafted, or mixed from two runs)"
        )


def _count(value: Any) -> str:
    return f"{len(value)} values" if isinstance(value, list) else f"a {type(value).__name__}"
