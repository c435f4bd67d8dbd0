"""Between two steps: evaluation when due, step_N saved every save_every steps and when a signal stops the run
(which ends the loop), the last step saved once."""

from dataclasses import dataclass, field

import torch

from mtk.training.boundary import StepBoundary
from mtk.training.setup import Evaluation


@dataclass
class FakeSignal:
    at_step: int | None = None
    step: int = 0
    name: str = "SIGTERM"

    def requested(self) -> bool:
        return self.at_step is not None and self.step >= self.at_step


@dataclass
class Calls:
    saved: list[str] = field(default_factory=list)
    evaluated: list[int] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def boundary(calls: Calls, signal: FakeSignal, *, save_every: int, every: int, with_data: bool = True) -> StepBoundary:
    evaluation = Evaluation(
        torch.nn.Linear(1, 1),
        [{"input_ids": torch.zeros(1, 1)}] if with_data else [],
        torch.device("cpu"),
        lambda t: t,
        signal,
        log=lambda scores, at: None,
        main_process=False,
        every=every,
    )
    recorded = _Recorded(evaluation, calls)
    return StepBoundary(
        calls.saved.append,
        "out",
        save_every,
        5,
        recorded,
        signal,
        calls.lines.append,
    )


class _Recorded:
    """The evaluation's schedule (due) with its call recorded instead of run."""

    def __init__(self, evaluation: Evaluation, calls: Calls) -> None:
        self.evaluation, self.calls, self.batches = evaluation, calls, evaluation.batches

    def due(self, step: int, last_step: int) -> bool:
        return self.evaluation.due(step, last_step)

    def __call__(self, step: int) -> bool:
        self.calls.evaluated.append(step)
        return True


def run(boundary: StepBoundary, signal: FakeSignal) -> int:
    assert boundary.begin()
    step = 0
    while True:
        step += 1
        signal.step = step
        if boundary.after(step):
            break
    boundary.finish(step)
    return step


def test_saves_every_n_steps_evaluates_when_due_and_the_last_step_once():
    calls, signal = Calls(), FakeSignal()
    assert run(boundary(calls, signal, save_every=2, every=2), signal) == 5
    assert calls.saved == ["out/step_2", "out/step_4", "out/step_5"]
    assert calls.evaluated == [0, 2, 4, 5]  # the starting point, every 2 steps, the last
    assert calls.lines == []


def test_a_signal_saves_the_step_it_finished_and_ends_the_loop():
    calls, signal = Calls(), FakeSignal(at_step=3)
    b = boundary(calls, signal, save_every=0, every=0, with_data=False)
    assert run(b, signal) == 3
    assert calls.saved == ["out/step_3"]  # once: finish() does not write it again
    assert b.stopped and calls.evaluated == []
    assert calls.lines == ["mtk: SIGTERM: saved out/step_3; continue with --resume auto"]
