"""What goes into and comes out of one pipeline call: the batch cut into micro-batches, whether the model's loss is
HF's token mean (so the pipeline can pass the batch's own token count), and TRL's fused-head fields of the last
stage gathered for every stage."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mtk.config import ConfigError
from mtk.data import IGNORE_INDEX
from mtk.parallel.state import ParallelState

__all__ = ["fused_output", "split_micro_batches", "token_mean_loss", "with_ignored_rows"]

FUSED_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")  # TRL's, [b, s']


def split_micro_batches(
    batch: dict[str, Any], count: int, group: int = 1, *, token_weighted: bool = False, any_sizes: bool = False
) -> list[dict[str, Any]]:
    """Cut every tensor of ``batch`` (or a context-parallel split's :class:`~mtk.parallel.context.ContextShard`,
    which chunks as one) into ``count`` equal chunks along the batch dimension.

    A batch that ``count`` does not divide (a data set's last, partial batch: the Trainer keeps it, as a single
    process trains it) is cut otherwise; the caller reports fewer chunks. A ``token_weighted`` loss (summed over
    tokens and divided by the batch's count, or weights on the log-probabilities) is exact over chunks of any size,
    so with ``any_sizes`` it keeps ``count`` chunks (sizes that differ by one: 61 rows in 8 are 8 chunks of 7 or 8,
    not one of 61, which would hold 8 times a step's activations). Otherwise the most equal chunks that divide it,
    in a multiple of ``group`` (the interleaved schedule's pp), keep every loss exact (a mean over rows is the mean
    of equal chunks' means); where none does, a ``token_weighted`` loss takes chunks that differ by one."""
    sizes = {len(t) for t in batch.values()}
    if len(sizes) != 1:
        raise ConfigError(f"pipeline inputs disagree on the batch size: { {k: len(t) for k, t in batch.items()} }")
    size = sizes.pop()
    counts = [n for n in range(min(count, size), 0, -1) if n % group == 0]
    equal = [n for n in counts if size % n == 0]
    if counts and token_weighted and any_sizes:
        pieces: int | None = counts[0]
    else:
        pieces = equal[0] if equal else counts[0] if counts and token_weighted else None
    if pieces is None:
        raise ConfigError(
            f"a batch of {size} sequences does not split into megatron_lm_num_micro_batches = {count}, nor into "
            f"fewer micro-batches in groups of pp = {group} (the interleaved schedule's"
            + ("" if counts else f": fewer sequences than {group}")
            + f"); use a batch size that is a multiple of {count} (a last, partial batch: drop it, "
            "dataloader_drop_last=True)"
        )
    chunks = {k: t.tensor_split(pieces) for k, t in batch.items()}
    return [{k: c[i] for k, c in chunks.items()} for i in range(pieces)]


def with_ignored_rows(batch: dict[str, Any], rows: int) -> dict[str, Any]:
    """``batch`` with its last row copied ``rows`` times, the copies' labels ignored and their token weights 0: no
    loss, no gradient, and a loss divided by the batch's own token count unchanged. The interleaved schedule sends
    micro-batches in groups of pp; a batch with fewer rows (a last, partial one) gets rows that count for nothing."""
    padded: dict[str, Any] = {}
    for name, tensor in batch.items():
        copies = tensor[-1:].expand(rows, *tensor.shape[1:])  # [rows, ...]
        if name in ("labels", "shift_labels"):
            copies = torch.full_like(copies, IGNORE_INDEX)
        elif name == "token_weights":
            copies = torch.zeros_like(copies)
        padded[name] = torch.cat([tensor, copies])  # [b + rows, ...]
    return padded


def token_mean_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> bool:
    """Whether ``model``'s loss on ``batch`` is HF's causal-LM token mean and takes ``num_items_in_batch`` (the
    Trainer's test: ``accepts_loss_kwargs``, else a ``**kwargs`` forward)."""
    labels = batch.get("labels")
    if labels is None or labels.shape != batch["input_ids"].shape:
        return False
    accepts = getattr(model, "accepts_loss_kwargs", None)
    if accepts is None:
        accepts = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())
    return bool(accepts)


def fused_output(outputs: list[Any], loss: torch.Tensor, parallel: ParallelState) -> Any:
    """TRL's ``FusedCausalLMOutput`` for the whole batch on every stage: the last stage's per-token fields of its
    micro-batches' ``outputs`` (empty elsewhere), concatenated in order (``[b, s']`` each, O(tokens) to broadcast),
    detached (the pipeline backpropagated the loss already)."""
    from trl.trainer.utils import FusedCausalLMOutput

    src, group = parallel.pp_ranks[-1], parallel.pp_group
    fields: dict[str, Any] = {}
    if outputs:
        for name in FUSED_FIELDS:
            if getattr(outputs[0], name, None) is not None:
                fields[name] = torch.cat([getattr(o, name).detach() for o in outputs])  # [b, s']
        if getattr(outputs[0], "aux_loss", None) is not None:
            fields["aux_loss"] = torch.stack([o.aux_loss.detach().float() for o in outputs]).mean()
    if parallel.pp_size > 1:
        layout = [{name: (tuple(t.shape), t.dtype) for name, t in fields.items()}]
        dist.broadcast_object_list(layout, src=src, group=group)
        for name, (shape, dtype) in layout[0].items():
            wire = fields[name].to(torch.float32) if name in fields else None
            if wire is None:
                wire = torch.empty(shape, dtype=torch.float32, device=parallel.device)
            wire = wire.to(parallel.device).contiguous()
            dist.broadcast(wire, src=src, group=group)
            fields[name] = wire.to(dtype)
    return FusedCausalLMOutput(loss=loss, **fields)
