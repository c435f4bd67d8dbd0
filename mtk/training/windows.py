"""A training loop's data, one optimizer step at a time: the step's micro-batches and HF's token weighting.

The loss of a step is the mean over every labelled token of the global batch (all accumulation micro-batches, all
DP replicas), known only once the step's micro-batches are read: :func:`step_windows` reads them together, counts
their labelled tokens over DP and says what each micro-batch passes as ``num_items_in_batch`` (the global count /
(accumulation x dp): accelerate and DeepSpeed divide each loss by the accumulation steps and DP averages, so the
step's gradient is that of the token mean; docs/data.md).

An epoch is whole steps: the micro-batches past the last whole step are not read (a step never spans two epochs,
where each would be shuffled differently). The position is the count of micro-batches consumed (what mtk's
checkpoints record), so a resumed run continues at the same micro-batch. Which micro-batch ends a step is the
window's last, said explicitly (:meth:`StepWindow.micro_batches`): reading a whole window ahead ends accelerate's
loader early, and its own rule (sync where the loader ended) would then step at every micro-batch of an epoch's
last window.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mtk.data.batching import loss_tokens
from mtk.errors import DataError

__all__ = ["StepWindow", "step_windows"]

Batch = dict[str, torch.Tensor]


@dataclass
class StepWindow:
    """One optimizer step's micro-batches on this replica."""

    batches: list[Batch]
    labelled: torch.Tensor  # labelled tokens of the global batch (all micro-batches, summed over DP)
    num_items: torch.Tensor  # each micro-batch's num_items_in_batch: labelled / (accumulation x dp)

    def micro_batches(self) -> Iterator[tuple[Batch, bool]]:
        """``(batch, last)``: ``last`` for the micro-batch that ends the step (it syncs and steps)."""
        for index, batch in enumerate(self.batches):
            yield batch, index == len(self.batches) - 1

    def tokens(self) -> int:
        """Positions of this replica's micro-batches, padding included (throughput)."""
        return sum(batch["input_ids"].numel() for batch in self.batches)


def step_windows(
    loader: Any,
    accumulation: int,
    seen: int,
    sum_over_dp: Callable[[torch.Tensor], torch.Tensor],
    dp_size: int,
    *,
    skip: Callable[[Any, int], Iterable[Batch]] | None = None,
    set_epoch: Callable[[int], None] | None = None,
) -> Iterator[StepWindow]:
    """The optimizer steps of ``loader``, epoch after epoch, from micro-batch ``seen`` on (endless: stop at the step
    count you want).

    ``sum_over_dp``: a sum over the DP replicas (``accelerator.reduce(t, "sum")``, an all-reduce on the DP group).
    ``skip``: how to start an epoch ``n`` micro-batches in (accelerate's ``skip_first_batches``; default: read and
    drop them). ``set_epoch``: reshuffle for an epoch (default: ``loader.set_epoch`` if it has one).
    """
    per_epoch = len(loader) // accumulation * accumulation  # whole steps
    if per_epoch == 0:
        raise DataError(
            f"the data gives {len(loader)} micro-batches per replica per epoch, fewer than one optimizer step of "
            f"{accumulation}; give more data, a smaller batch or fewer accumulation steps"
        )
    set_epoch = set_epoch or getattr(loader, "set_epoch", None)
    while True:
        epoch, start = divmod(seen, per_epoch)
        if set_epoch is not None:
            set_epoch(epoch)
        if start and skip is not None:
            batches = iter(skip(loader, start))
        else:
            batches = itertools.islice(iter(loader), start, None)
        for _ in range((per_epoch - start) // accumulation):
            window = list(itertools.islice(batches, accumulation))
            labelled = sum_over_dp(torch.stack([loss_tokens(batch) for batch in window]).sum())
            seen += accumulation
            yield StepWindow(window, labelled, labelled.float() / (accumulation * dp_size))
