"""The order in which one pipeline rank runs forward and backward passes of its micro-batches.

A schedule is only an order of :class:`Pass` es: ``forward`` and ``backward`` of micro-batch ``i`` on
model chunk ``c`` (which receive, compute and send) are given by the engine. With ``p`` stages and
``m`` micro-batches:

- **AFAB** (all forward, all backward; GPipe's flush): every stage runs ``m`` forwards, then ``m``
  backwards. Each stage holds the activations of all ``m`` micro-batches at the turn.
- **1F1B** (PipeDream-flush): stage ``s`` runs ``p - s - 1`` warm-up forwards, then alternates one
  forward and one backward, then drains the remaining backwards. Same bubble as AFAB, but stage ``s``
  never holds more than ``p - s`` micro-batches of activations (the first stage: ``p``).
- **Interleaved 1F1B** (Megatron's virtual pipeline): the model is cut into ``p * v`` chunks and rank
  ``s`` holds chunks ``s, s + p, s + 2p, ...`` (``v`` of them). Micro-batches go through the chunks in
  groups of ``p``: the forward sequence is ``p`` micro-batches on chunk 0, the same ``p`` on chunk 1, ...
  then the next ``p`` on chunk 0, the backward sequence the same with chunks reversed; every rank runs
  those sequences, 1F1B style, after ``2 (p - s - 1) + (v - 1) p`` warm-up forwards. ``m`` must be a
  multiple of ``p``.

AFAB and 1F1B idle ``(p - 1)`` forward+backward slots per stage out of ``m + p - 1``; interleaving
makes a slot ``1/v`` as long. Two quantities, two names:

- :func:`bubble_fraction`: the idle share of the schedule's time, ``(p - 1) / (v m + p - 1)`` (what a
  measurement of a stage's idle time, or :func:`simulate`, gives);
- :func:`bubble_overhead`: the idle time over the compute time, ``(p - 1) / (v m)``: a stage computing for
  ``t`` runs a step of ``t (1 + bubble_overhead)`` (what the planner and the bench's ideal add to a stage's
  compute).

:func:`peak_in_flight` counts the micro-batches (chunk passes) whose activations a rank holds at once in its
order: the planner's activation memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from mtk.config import check_schedule

__all__ = [
    "Pass",
    "Simulation",
    "bubble_fraction",
    "bubble_overhead",
    "peak_in_flight",
    "schedule_order",
    "simulate",
]


class Pass(NamedTuple):
    """One forward (``"F"``) or backward (``"B"``) of a micro-batch on one of this rank's model chunks."""

    kind: str
    micro_batch: int
    chunk: int = 0


def schedule_order(
    name: str, num_micro_batches: int, stage: int, num_stages: int, virtual_stages: int = 1
) -> list[Pass]:
    """The passes one pipeline rank runs, in order."""
    problem = check_schedule(name, num_stages, num_micro_batches, virtual_stages)
    if problem:
        raise ValueError(problem)
    m = num_micro_batches
    if name == "afab":
        return [Pass("F", i) for i in range(m)] + [Pass("B", i) for i in range(m)]
    if name == "1f1b":
        return _one_forward_one_backward(
            [Pass("F", i) for i in range(m)], [Pass("B", i) for i in range(m)], num_stages - stage - 1
        )
    p, v = num_stages, virtual_stages

    def nth(kind: str, k: int) -> Pass:  # the k-th forward (backward) of the shared sequence
        group = (k // p) % v
        return Pass(kind, (k // (p * v)) * p + k % p, group if kind == "F" else v - 1 - group)

    total = m * v
    warmup = total if m == p else 2 * (p - stage - 1) + (v - 1) * p
    return _one_forward_one_backward([nth("F", k) for k in range(total)], [nth("B", k) for k in range(total)], warmup)


def _one_forward_one_backward(forwards: list[Pass], backwards: list[Pass], warmup: int) -> list[Pass]:
    """``warmup`` forwards, then one forward and one backward in turn, then the remaining backwards."""
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards):
        order += [forward, backward]
    return order + backwards[len(forwards) - warmup :]


def bubble_fraction(num_stages: int, num_micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle share of the schedule's time, ``(p - 1) / (v m + p - 1)``, when forward and backward times are
    equal across stages."""
    return (num_stages - 1) / (virtual_stages * num_micro_batches + num_stages - 1)


def bubble_overhead(num_stages: int, num_micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle time over compute time, ``(p - 1) / (v m)``: the schedule takes ``1 + this`` times a stage's
    compute (Megatron's bubble; ``bubble_fraction = overhead / (1 + overhead)``)."""
    return (num_stages - 1) / (virtual_stages * num_micro_batches)


def peak_in_flight(name: str, num_micro_batches: int, stage: int, num_stages: int, virtual_stages: int = 1) -> int:
    """Most passes (of one micro-batch through one of the rank's chunks) whose activations ``stage`` holds at
    once: forwards run whose backward has not. 1F1B: ``min(m, p - s)``; AFAB: ``m``; interleaved:
    ``2 (p - s - 1) + (v - 1) p`` warm-up forwards plus one (``m v`` when ``m = p``), each ``1/v`` of a stage."""
    held = peak = 0
    for step in schedule_order(name, num_micro_batches, stage, num_stages, virtual_stages):
        held += 1 if step.kind == "F" else -1
        peak = max(peak, held)
    return peak


@dataclass(frozen=True)
class Simulation:
    """A schedule run on paper: every pass takes its time, every message arrives when sent."""

    step_s: float
    idle: tuple[float, ...]  # per stage: share of the step spent waiting


def simulate(
    name: str,
    num_stages: int,
    num_micro_batches: int,
    virtual_stages: int = 1,
    forward_s: float = 1.0,
    backward_s: float = 1.0,
) -> Simulation:
    """Run every rank's order with the engine's transfer rules: non-blocking sends, blocking receives,
    one first-in first-out channel per (sender, receiver) pair. Raises ``ValueError`` if a receive would
    take another message than the one it waits for, or the ranks deadlock: a schedule that passes runs
    as written on gloo and NCCL alike. ``forward_s``/``backward_s``: one micro-batch through a whole stage.
    """
    p, m, v = num_stages, num_micro_batches, virtual_stages
    orders = [schedule_order(name, m, stage, p, v) for stage in range(p)]
    position, free, busy = [0] * p, [0.0] * p, [0.0] * p
    channels: dict[tuple[int, int], list[tuple[Pass, float]]] = {}  # (sender, receiver) -> messages in flight

    def neighbour(stage: int, chunk: int, step: int) -> tuple[int, int] | None:  # the next (+1) or previous chunk
        index = chunk * p + stage + step
        return (index % p, index // p) if 0 <= index < p * v else None

    progress = True
    while progress:
        progress = False
        for stage in range(p):
            if position[stage] == len(orders[stage]):
                continue
            now = orders[stage][position[stage]]
            source = neighbour(stage, now.chunk, -1 if now.kind == "F" else 1)
            start = free[stage]
            if source is not None:
                queue = channels.get((source[0], stage), [])
                if not queue:
                    continue  # blocked until the neighbour sends
                message, sent = queue.pop(0)
                if message != now:
                    raise ValueError(f"{name}: stage {stage} waits for {now} but its neighbour sent {message} first")
                start = max(start, sent)
            free[stage] = start + (forward_s if now.kind == "F" else backward_s) / v
            busy[stage] += (forward_s if now.kind == "F" else backward_s) / v
            position[stage] += 1
            progress = True
            target = neighbour(stage, now.chunk, 1 if now.kind == "F" else -1)
            if target is not None:
                channels.setdefault((stage, target[0]), []).append((now._replace(chunk=target[1]), free[stage]))
    if position != [len(order) for order in orders]:
        raise ValueError(f"{name}: the stages deadlock at passes {position} (pp = {p}, m = {m}, v = {v})")
    step = max(free)
    return Simulation(step, tuple(1 - b / step for b in busy))
