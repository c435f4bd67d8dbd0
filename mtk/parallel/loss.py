"""Cross-entropy over vocab-parallel logits, without ever gathering the logits.

Each TP rank holds logits ``z[..., start:end]`` for its slice of the vocabulary. The loss of a token
with target t is ``log(sum_j exp(z_j - m)) - (z_t - m)`` for any constant m; with m the global max it
is numerically safe. Only per-token scalars cross ranks:

1. all-reduce(MAX) of the local maxima                      -> m            [b, s]
2. all-reduce(SUM) of [sum_j exp(z_j - m), z_t - m]          -> both terms   [2, b, s]

(the target logit is non-zero on exactly one rank, so summing picks it). Communication is O(b*s),
independent of the vocabulary. The gradient, ``softmax(z) - onehot(t)``, is local: backward issues no
collective. Columns at or past the real vocabulary size (TP padding) are excluded from the softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtk.parallel.comm import Group, all_reduce, group_rank, group_size

__all__ = ["vocab_parallel_cross_entropy", "vocab_slice"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size, ignore_index):
        # logits: [..., V/tp] this rank's columns; target: [...] global ids
        local_vocab = logits.shape[-1]
        real_columns = max(0, min(local_vocab, vocab_size - vocab_start))
        # at least fp32 statistics whatever the compute dtype; fp64 stays fp64 (a true fp64 reference)
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # [..., V/tp]
        if real_columns < local_vocab:
            z = z.clone() if z is logits else z
            z[..., real_columns:] = float("-inf")  # padded vocabulary takes no probability mass
        z_max = z.amax(dim=-1)  # [...]
        all_reduce(z_max, group, op=dist.ReduceOp.MAX)
        shifted = z - z_max.unsqueeze(-1)  # [..., V/tp], fresh tensor we may overwrite

        local_target = target - vocab_start  # [...]
        owned = (local_target >= 0) & (local_target < real_columns) & (target != ignore_index)  # [...]
        index = local_target.masked_fill(~owned, 0)  # [...]
        target_logit = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * owned  # [...]

        exp = shifted.exp_()  # [..., V/tp]
        stats = torch.stack([exp.sum(dim=-1), target_logit])  # [2, ...]
        all_reduce(stats, group)
        sum_exp, target_logit = stats[0], stats[1]

        valid = target != ignore_index  # [...]
        loss = (torch.log(sum_exp) - target_logit).masked_fill(~valid, 0.0)  # [...]
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # [..., V/tp]
        ctx.save_for_backward(softmax, index, owned, valid)
        ctx.input_dtype = logits.dtype
        ctx.backward_done = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.backward_done:
            raise RuntimeError(
                "vocab_parallel_cross_entropy reuses its saved softmax for the gradient and can be "
                "back-propagated once; do not call backward(retain_graph=True) through it twice"
            )
        ctx.backward_done = True
        softmax, index, owned, valid = ctx.saved_tensors
        grad = softmax  # [..., V/tp]: d loss / d z = softmax - onehot(target)
        grad.scatter_add_(-1, index.unsqueeze(-1), -owned.unsqueeze(-1).to(grad.dtype))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None, None


def vocab_slice(
    logits: torch.Tensor, target: torch.Tensor, tp_group: Group, vocab_start: int | None, vocab_size: int | None
) -> tuple[int, int]:
    """This rank's first global column and the real vocabulary size (defaults: even slices, no padding), after
    checking that ``logits [..., V/tp]`` and ``target [...]`` agree before the vocabulary dimension."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree before the vocab dim"
        )
    if vocab_start is None:
        vocab_start = group_rank(tp_group) * logits.shape[-1]
    if vocab_size is None:
        vocab_size = logits.shape[-1] * group_size(tp_group)  # no padding
    return vocab_start, vocab_size


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: Group,
    *,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of vocab-parallel ``logits [..., V/tp]`` against global ``target [...]`` ids.

    Args:
        logits: this rank's contiguous slice of the vocabulary columns.
        target: target token ids (global), ``ignore_index`` where no loss is wanted.
        tp_group: the tensor-parallel group the vocabulary is split over.
        vocab_start: first global column this rank holds; default ``tp_rank * V/tp``.
        vocab_size: the real vocabulary size; columns at or past it (TP padding) are excluded.
        reduction: ``mean`` over non-ignored tokens (as ``F.cross_entropy``), ``sum`` or ``none``.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    vocab_start, vocab_size = vocab_slice(logits, target, tp_group, vocab_start, vocab_size)
    losses = _VocabParallelCrossEntropy.apply(logits, target, tp_group, vocab_start, vocab_size, ignore_index)
    if reduction == "none":
        return losses
    total = losses.sum()
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum()
