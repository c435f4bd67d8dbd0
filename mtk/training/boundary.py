"""What a fine-tuning loop does between two optimizer steps, the same under accelerate and DeepSpeed: evaluate when
due, agree over the ranks whether a signal asks the run to stop, save ``step_N`` every ``save_every`` steps and
when stopping, and say whether the loop ends.

The order matters for preemption: an evaluation a signal cut short logs nothing, the agreement that follows sees
the signal on every rank, and the run saves the step it finished before it stops, so ``--resume auto`` continues
exactly where it left off. :meth:`StepBoundary.finish` saves the last step once, if no boundary saved it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mtk.training.setup import Evaluation
from mtk.training.signals import ExitSignal

__all__ = ["StepBoundary"]


@dataclass
class StepBoundary:
    """``boundary.begin()`` before the first step, ``boundary.after(step)`` after each optimizer step (``True``:
    leave the loop), ``boundary.finish(step)`` after the loop. Collective: every rank calls them at every step."""

    save: Callable[[str], None]  # writes a checkpoint directory (accelerator.save_state, DeepSpeed's save)
    output_dir: str
    save_every: int  # 0: only when stopping and at the end
    max_steps: int
    evaluation: Evaluation
    exit_signal: ExitSignal
    report: Callable[[str], None]  # a line for the user, printed once
    saved_step: int = 0  # the step of the newest checkpoint: the run's starting step until one is written
    stopped: bool = False  # a signal stopped the run (it saved first)

    def begin(self) -> bool:
        """Evaluate a fresh run's starting point, for comparison; ``False`` when a signal cut that short (the run
        then stops with nothing to save)."""
        if self.saved_step == 0 and self.evaluation.batches:
            return self.evaluation(0)
        return True

    def after(self, step: int) -> bool:
        """Evaluate, agree on a signal, save; whether the loop ends after ``step``."""
        if self.evaluation.due(step, self.max_steps):
            self.evaluation(step)  # a signal stops it early; the agreement below then stops the run
        self.stopped = self.exit_signal.requested()  # agreed over all ranks: all stop (and save) at this step
        if (self.save_every and step % self.save_every == 0) or self.stopped:
            self._save(step)
        if self.stopped:
            self.report(
                f"mtk: {self.exit_signal.name}: saved {self.output_dir}/step_{step}; continue with --resume auto"
            )
        return step >= self.max_steps or self.stopped

    def finish(self, step: int) -> None:
        """Save ``step`` unless a boundary already did."""
        if self.saved_step != step:
            self._save(step)

    def _save(self, step: int) -> None:
        self.save(f"{self.output_dir}/step_{step}")
        self.saved_step = step
