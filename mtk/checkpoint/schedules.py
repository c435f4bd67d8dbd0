"""A restored learning-rate schedule's rate as this run's schedule gives it.

An optimizer restores the saved run's learning rate, and ``LambdaLR.load_state_dict`` restores its position and
leaves that rate: a resume with a longer ``--max_steps`` (``--resume ckpts/step_60 --max_steps 120``) ran its first
step at the old schedule's last value (0 for a linear decay), moving nothing while Adam's moments advanced
(transformers' Trainer still does; DeepSpeed's schedulers, restored by position alone, did the same). Where the
schedule is the saved one, its rate is the restored one bit for bit: the same product ``base_lr * factor(position)``
that ``LambdaLR`` computed when it stepped there.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["follow_the_schedule"]


def follow_the_schedule(scheduler: Any) -> None:
    """Set each group's rate from ``scheduler``'s schedule at its position: a ``LambdaLR`` (accelerate's wrapper's
    too) or one of DeepSpeed's (a JSON's ``"scheduler"`` block under the Trainer: ``WarmupDecayLR`` with
    ``total_num_steps`` from this run's ``max_steps``); any other scheduler's rate depends on its past rates, and
    stays as restored."""
    scheduler = getattr(scheduler, "scheduler", scheduler)  # (accelerate's AcceleratedScheduler)
    if type(scheduler).__module__ == "deepspeed.runtime.lr_schedules":
        if scheduler.last_batch_iteration >= 0:  # each of them sets its rates (and momenta) from the position alone
            scheduler.step(scheduler.last_batch_iteration)
        return
    if type(scheduler) is not torch.optim.lr_scheduler.LambdaLR:
        return
    position = scheduler.last_epoch
    rates = [base * factor(position) for factor, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
    for group, rate in zip(scheduler.optimizer.param_groups, rates):
        if isinstance(group["lr"], torch.Tensor):  # (a captured rate: changed in place, as torch's schedulers do)
            group["lr"].fill_(rate)
        else:
            group["lr"] = rate
    scheduler._last_lr = [
        group["lr"].clone() if isinstance(group["lr"], torch.Tensor) else group["lr"]
        for group in scheduler.optimizer.param_groups
    ]
