"""Evaluation loss and perplexity, token-weighted at every layout.

The loss of an evaluation set is the mean cross-entropy over all of its labelled tokens, as one process
computes it: each batch's forward returns its *summed* token losses (``num_items_in_batch=1``, HF's
convention; a pipelined model runs its forward-only schedule and gets the same sum), and the sums and
token counts are added over batches and DP replicas before dividing. Batches come from
:func:`mtk.data.eval_batches`, so every replica runs the same number of forwards.

A long evaluation must not outlast a scheduler's grace period: given ``stop`` (a collective check such as
:meth:`mtk.training.signals.ExitSignal.requested`), every rank asks it after each batch, so all stop at the same
batch within one forward of a SIGTERM, and the evaluation returns ``None`` (partial scores are no scores).
"""

from __future__ import annotations

import math
import resource
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from mtk.data.batching import loss_tokens

__all__ = ["evaluate", "peak_memory_mib"]


def evaluate(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    device: torch.device,
    sum_over_replicas: Callable[[torch.Tensor], torch.Tensor],
    stop: Callable[[], bool] | None = None,
) -> dict[str, float] | None:
    """``{"eval/loss", "eval/perplexity", "eval/tokens"}`` over ``batches`` (this replica's share), or ``None``
    when ``stop()`` said so after a batch.

    ``sum_over_replicas`` adds a tensor over the data-parallel group (``accelerator.reduce(t, "sum")``); ``stop``
    must agree over every rank of the job (it is called after each batch on each).
    Collective: every rank of the job calls it, with its replica's batches.
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # [summed token loss, labelled tokens]
    stopped = False
    with torch.no_grad():
        for batch in batches:
            batch = {key: value.to(device) for key, value in batch.items()}
            summed = model(**batch, num_items_in_batch=1, use_cache=False).loss  # summed token losses
            totals += torch.stack([summed.double(), loss_tokens(batch).double()])
            if stopped := stop is not None and stop():  # collective: every rank breaks at the same batch
                break
    model.train(was_training)
    if stopped:
        return None
    loss_sum, tokens = sum_over_replicas(totals).tolist()
    loss = loss_sum / tokens if tokens else float("nan")
    return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 700.0)), "eval/tokens": tokens}


def peak_memory_mib(device: torch.device) -> list[float]:
    """Every rank's peak memory so far, in MiB, in rank order: the accelerator's allocator peak on a GPU,
    the process's peak resident set on the CPU. Collective when a process group exists."""
    if device.type == "cpu":
        mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    else:
        mine = torch.accelerator.max_memory_allocated(device) / 2**20
    if not dist.is_initialized():
        return [mine]
    everyone: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone
