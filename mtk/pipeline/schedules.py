"""The order in which one stage runs forward and backward passes of its micro-batches.

A schedule is only an order: ``forward(i)`` and ``backward(i)`` (which receive, compute and send)
are given by the engine. With ``p`` stages and ``m`` micro-batches:

- **AFAB** (all forward, all backward; GPipe's flush): every stage runs ``m`` forwards, then ``m``
  backwards. Each stage holds the activations of all ``m`` micro-batches at the turn.
- **1F1B** (PipeDream-flush): stage ``s`` runs ``p - s - 1`` warm-up forwards, then alternates one
  forward and one backward, then drains the remaining backwards. Same bubble as AFAB, but stage ``s``
  never holds more than ``p - s`` micro-batches of activations (the first stage: ``p``).

Both idle ``(p - 1)`` forward+backward slots per stage out of ``m + p - 1``: the bubble fraction is
``(p - 1) / (m + p - 1)``.
"""

from __future__ import annotations

__all__ = ["bubble_fraction", "schedule_order"]


def schedule_order(name: str, num_micro_batches: int, stage: int, num_stages: int) -> list[tuple[str, int]]:
    """``[("F", 0), ("F", 1), ("B", 0), ...]``: the passes one stage runs, in order."""
    m = num_micro_batches
    if name == "afab":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if name == "1f1b":
        warmup = min(num_stages - stage - 1, m)
        order = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i), ("B", i)]
        return order + [("B", i) for i in range(m - warmup, m)]
    raise ValueError(f"unknown pipeline schedule {name!r}; use afab or 1f1b")


def bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
    """Idle share of a stage's step when forward and backward times are equal across stages."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)
