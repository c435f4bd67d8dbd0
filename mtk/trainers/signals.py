"""A signal to a Trainer run saves ``checkpoint-N`` and stops it, as mtk's scripts do (:mod:`mtk.training.signals`).

Schedulers send SIGTERM some time before they kill a job; transformers' Trainer installs no handler, so the run
died at once without a word and lost every step since its last checkpoint. mtk's scripts save at the next step
boundary instead (Megatron's exit-signal handler); :class:`SaveAndStopOnSignal` does the same through the Trainer's
own callback controls, so the checkpoint is the Trainer's ``checkpoint-N`` and ``resume_from_checkpoint=True``
continues exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tqdm.auto import tqdm
from transformers import TrainerCallback

from mtk.errors import ConfigError
from mtk.training.signals import ExitSignal

__all__ = ["EvaluationStopsOnSignal", "SaveAndStopOnSignal"]


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


class _EvaluationStopped(Exception):
    """Raised out of an evaluation's loader when a signal arrived: the evaluation ends there, unlogged."""


class _StopsOnSignal:
    """An evaluation's data loader that ends the evaluation when any rank received a signal, asked before each
    batch (a collective: accelerate's loaders give every rank the same number of batches)."""

    def __init__(self, loader: Any, exit_signal: ExitSignal) -> None:
        self._loader = loader
        self._exit_signal = exit_signal

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def __iter__(self) -> Iterator[Any]:
        for batch in self._loader:
            if self._exit_signal.requested():
                raise _EvaluationStopped
            yield batch


class EvaluationStopsOnSignal:
    """The evaluation hooks of :class:`~mtk.trainers.base.ParallelTrainerMixin`: a signal during an evaluation
    inside ``train()`` ends it after the batch it arrived in, unlogged (its metrics would cover part of the set),
    and the step is saved at once, as mtk's scripts do. transformers ran the whole evaluation, logged it and
    trained one more step before the save (71 s after a SIGTERM in a 77-s evaluation: past a scheduler's grace
    time). Outside ``train()`` (``evaluate()`` called by a script) evaluations run as transformers' do."""

    control: Any
    state: Any
    accelerator: Any
    model: Any
    _signal_stop: SaveAndStopOnSignal | None = None
    _evaluation_stopped: bool = False

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        loader = super().get_eval_dataloader(eval_dataset)  # type: ignore[misc]
        return loader if self._signal_stop is None else _StopsOnSignal(loader, self._signal_stop.exit_signal)

    def _evaluate(self, trial: Any, ignore_keys_for_eval: Any, skip_scheduler: bool = False) -> dict[str, float]:
        self._evaluation_stopped = False
        try:
            with _metric_refusals():
                return super()._evaluate(trial, ignore_keys_for_eval, skip_scheduler)  # type: ignore[misc]
        except _EvaluationStopped:
            assert self._signal_stop is not None
            self._evaluation_stopped = True
            self.control.should_save = self.control.should_training_stop = True
            self._signal_stop.stopped_at = self.state.global_step
            self.model.train()  # (the evaluation left it in eval mode: TRL's log would read its partial metrics)
            partial = getattr(self, "_metrics", None)  # TRL's per-mode accumulators
            if isinstance(partial, dict) and hasattr(partial.get("eval"), "clear"):
                partial["eval"].clear()
            if self.accelerator.is_main_process:
                step, name = self.state.global_step, self._signal_stop.signal_name
                tqdm.write(f"mtk: {name}: the evaluation at step {step} stopped early, not logged")
            return {}

    def _determine_best_metric(self, metrics: dict[str, float], trial: Any) -> bool:
        """transformers'; after an evaluation a signal cut short there are no metrics: the best stays as it was,
        and under ``save_strategy="best"`` the save the signal asks for still happens."""
        if self._evaluation_stopped:
            return bool(self.control.should_save)
        with _metric_refusals():
            return super()._determine_best_metric(metrics, trial)  # type: ignore[misc]


@contextlib.contextmanager
def _metric_refusals() -> Iterator[None]:
    """``metric_for_best_model`` naming no metric the evaluation returns: transformers' ``KeyError`` (raised after
    the first evaluation, as a traceback on every rank) as one line, its own message."""
    try:
        yield
    except KeyError as err:
        message = str(err.args[0]) if err.args else ""
        if "metric_for_best_model" not in message:
            raise
        raise ConfigError(message.split(". Please")[0]) from err
