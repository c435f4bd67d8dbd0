"""A signal to a Trainer run saves ``checkpoint-N`` and stops it, as mtk's scripts do (:mod:`mtk.training.signals`).

Schedulers send SIGTERM some time before they kill a job; transformers' Trainer installs no handler, so the run
died at once without a word and lost every step since its last checkpoint. mtk's scripts save at the next step
boundary instead (Megatron's exit-signal handler); :class:`SaveAndStopOnSignal` does the same through the Trainer's
own callback controls, so the checkpoint is the Trainer's ``checkpoint-N`` and ``resume_from_checkpoint=True``
continues exactly.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from mtk.training.signals import ExitSignal

__all__ = ["SaveAndStopOnSignal"]


class SaveAndStopOnSignal(TrainerCallback):
    """At the end of each optimizer step the ranks agree whether any of them received SIGTERM, SIGINT or SIGHUP (a
    collective: every rank's Trainer reaches ``on_step_end`` at the same steps); if one did, the Trainer saves that
    step's checkpoint and stops, on every rank. ``stopped_at``: the step it stopped at (``None``: it was not)."""

    def __init__(self, exit_signal: ExitSignal) -> None:
        self.exit_signal = exit_signal
        self.stopped_at: int | None = None

    @property
    def signal_name(self) -> str:
        return self.exit_signal.name

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.exit_signal.requested():  # save now (no evaluation first: a preemption's grace time is short)
            control.should_save = True
            control.should_evaluate = False
            control.should_training_stop = True
            self.stopped_at = state.global_step
        return control

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.stopped_at is not None:  # the step is saved: no evaluation or second save at the epoch's end
            control.should_save = False
            control.should_evaluate = False
        return control
