"""Per-token statistics of vocab-parallel logits, without ever gathering the vocabulary on a rank.

TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``, used by its SFT, DPO, KTO, GRPO and RLOO
trainers) returns, for every token with target t, statistics of the next-token distribution
``p = softmax(z)`` over the scaled logits ``z = softcap * tanh(logit_scale * y / softcap) / temperature``
(in that order; no tanh without a softcap):

=================  =====================================  ============================================
statistic          definition                             from per-token sums over the vocabulary
=================  =====================================  ============================================
log_probs          ``log p_t``                            ``-vocab_parallel_cross_entropy(z, t)``
entropy            ``-sum_v p_v log p_v``                 ``log Z - sum_v e_v z_v / sum_v e_v``
log_sum_sq_probs   ``log sum_v p_v^2``                    ``log sum_v e_v^2 - 2 log sum_v e_v``
mean_logits        ``sum_v z_v / V``                      ``sum_v z_v / V``
is_top1            ``argmax_v z_v == t`` (first index)    ``z_t >= max_v z_v  and  z_t > max_{v<t} z_v``
=================  =====================================  ============================================

with ``e_v = exp(z_v - m)``, m the global max and ``log Z = m + log sum_v e_v``. Each rank holds columns
``[start, start + V/tp)`` of the padded vocabulary, so every statistic is a per-token MAX or SUM over ranks:
an O(tokens) all-reduce, independent of V. ``log_probs`` alone is the cross-entropy's two all-reduces (it *is*
that function, so a loss built on it equals mtk's causal-LM loss); any other statistic adds two more (MAX of
``[m, max_{v<t} z_v]``, then SUM of the needed sums). Columns at or past the real vocabulary size (TP padding)
take no part: no probability mass, no share of the mean, no gradient. With one rank (or no group) this is
plain torch on the full vocabulary.

``log_probs`` and ``entropy`` are differentiable (GRPO adds an entropy bonus to its loss); backward is local:
``d log p_t / dz_v = 1[v = t] - p_v`` and ``d H / dz_v = -p_v (log p_v + H)``. ``log_sum_sq_probs``,
``mean_logits`` and ``is_top1`` carry no gradient, as in TRL. Tokens whose target is ``ignore_index`` get 0
(``False``) in every statistic, as TRL's output fields do.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from mtk.parallel.comm import Group, all_reduce
from mtk.parallel.loss import vocab_parallel_cross_entropy, vocab_slice

__all__ = ["STATISTICS", "TokenStats", "vocab_parallel_token_stats"]

STATISTICS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class TokenStats(NamedTuple):
    """Per-token statistics, each shaped like the targets; ``None`` where not requested."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None


def _scaled_logits(
    logits: torch.Tensor, real_columns: int, logit_scale: float, softcap: float | None, temperature: float
) -> torch.Tensor:
    """TRL's transform, in TRL's order and precision: at least fp32, times ``logit_scale``, softcapped, times
    ``1 / temperature``. Padded columns become 0 first (0 stays 0 through every step), so junk there can
    neither leak into a sum nor send a NaN back through the softcap's gradient."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # [..., V/tp]
    if real_columns < z.shape[-1]:
        padded = torch.arange(z.shape[-1], device=z.device) >= real_columns  # [V/tp]
        z = z.masked_fill(padded, 0.0)
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if temperature != 1.0:
        z = z * (1 / temperature)  # as TRL: a multiply by the inverse, not a division
    return z


class _VocabParallelMoments(torch.autograd.Function):
    """entropy (differentiable), log_sum_sq_probs, mean_logits, is_top1 of vocab-parallel scaled logits.

    Forward: all-reduce(MAX) of ``[m, max_{v<t} z_v]``, then all-reduce(SUM) of the per-token sums the
    requested statistics need. Backward (entropy only): ``-p_v (log p_v + H)``, local, no collective.
    """

    @staticmethod
    def forward(ctx, z, target, group, vocab_start, vocab_size, ignore_index, wanted):
        # z: [..., V/tp] scaled logits, 0 on padded columns; target: [...] global ids
        ctx.set_materialize_grads(False)
        local_vocab = z.shape[-1]
        real_columns = max(0, min(local_vocab, vocab_size - vocab_start))
        column = torch.arange(vocab_start, vocab_start + local_vocab, device=z.device)  # [V/tp] global ids
        valid = target != ignore_index  # [...]
        masked = z.masked_fill(column >= vocab_size, float("-inf"))  # [..., V/tp]
        before = masked.masked_fill(column >= target.unsqueeze(-1), float("-inf"))  # [..., V/tp]: v < t only
        maxima = torch.stack([masked.amax(dim=-1), before.amax(dim=-1)])  # [2, ...]
        all_reduce(maxima, group, op=dist.ReduceOp.MAX)
        z_max, max_before = maxima[0], maxima[1]  # [...]

        exp = (masked - z_max.unsqueeze(-1)).exp()  # [..., V/tp], 0 on padded columns
        local_target = target - vocab_start  # [...]
        owned = (local_target >= 0) & (local_target < real_columns) & valid  # [...]
        index = local_target.masked_fill(~owned, 0).unsqueeze(-1)  # [..., 1]
        sums = {
            "sum_exp": exp.sum(dim=-1),
            "x_sum_exp": (exp * z).sum(dim=-1) if "entropy" in wanted else None,
            "sq_sum_exp": (exp * exp).sum(dim=-1) if "log_sum_sq_probs" in wanted else None,
            "z_sum": z.sum(dim=-1) if "mean_logits" in wanted else None,  # padded columns are 0
            "target": torch.where(owned, z.gather(-1, index).squeeze(-1), 0.0) if "is_top1" in wanted else None,
        }
        names = [name for name, value in sums.items() if value is not None]
        stacked = torch.stack([sums[name] for name in names])  # [k, ...]
        all_reduce(stacked, group)
        total = dict(zip(names, stacked))
        log_sum_exp = total["sum_exp"].log()  # [...]
        log_z = z_max + log_sum_exp  # [...]

        entropy = log_sum_sq = mean = is_top1 = None
        if "entropy" in wanted:
            entropy = (log_z - total["x_sum_exp"] / total["sum_exp"]).masked_fill(~valid, 0.0)
        if "log_sum_sq_probs" in wanted:
            log_sum_sq = (total["sq_sum_exp"].log() - 2 * log_sum_exp).masked_fill(~valid, 0.0)
        if "mean_logits" in wanted:
            mean = (total["z_sum"] / vocab_size).masked_fill(~valid, 0.0)
        if "is_top1" in wanted:
            is_top1 = (total["target"] >= z_max) & (total["target"] > max_before) & valid

        needs_grad = entropy is not None and ctx.needs_input_grad[0]
        ctx.save_for_backward(*((z, log_z, entropy, valid) if needs_grad else ()))
        ctx.real_columns = real_columns
        ctx.mark_non_differentiable(*(x for x in (log_sum_sq, mean, is_top1) if x is not None))
        return entropy, log_sum_sq, mean, is_top1

    @staticmethod
    def backward(ctx, grad_entropy, *_):
        if grad_entropy is None or not ctx.saved_tensors:
            return (None,) * 7
        z, log_z, entropy, valid = ctx.saved_tensors
        log_p = z - log_z.unsqueeze(-1)  # [..., V/tp]
        p = log_p.exp()  # [..., V/tp]
        if ctx.real_columns < z.shape[-1]:
            p[..., ctx.real_columns :] = 0.0  # padded columns hold no probability
        g = (grad_entropy * valid).unsqueeze(-1)  # [..., 1]; ignored tokens' entropy is a constant 0
        return -g * p * (log_p + entropy.unsqueeze(-1)), None, None, None, None, None, None


def vocab_parallel_token_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: Group,
    *,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    outputs: tuple[str, ...] = STATISTICS,
    temperature: float = 1.0,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
    ignore_index: int = -100,
) -> TokenStats:
    """TRL's per-token statistics (module docstring) of vocab-parallel ``logits [..., V/tp]`` against global
    ``target [...]`` ids; each result is ``[...]``, in fp32 (fp64 stays fp64), ``is_top1`` bool.

    Args:
        logits: this rank's contiguous slice of the (padded) vocabulary columns, before any scaling.
        target: target token ids (global), ``ignore_index`` where no statistic is wanted.
        tp_group: the tensor-parallel group the vocabulary is split over.
        vocab_start: first global column this rank holds; default ``tp_rank * V/tp``.
        vocab_size: the real vocabulary size; columns at or past it (TP padding) take no part.
        outputs: statistics to compute, among :data:`STATISTICS`; ``log_probs`` always is.
        temperature, final_logit_softcapping, logit_scale: TRL's logit transform (module docstring).
    """
    unknown = sorted(set(outputs) - set(STATISTICS))
    if unknown:
        raise ValueError(f"unknown statistics {unknown}; valid: {list(STATISTICS)}")
    vocab_start, vocab_size = vocab_slice(logits, target, tp_group, vocab_start, vocab_size)
    real_columns = max(0, min(logits.shape[-1], vocab_size - vocab_start))
    z = _scaled_logits(logits, real_columns, logit_scale, final_logit_softcapping, temperature)  # [..., V/tp]
    where = dict(vocab_start=vocab_start, vocab_size=vocab_size, ignore_index=ignore_index)
    log_probs = -vocab_parallel_cross_entropy(z, target, tp_group, reduction="none", **where)  # [...]
    wanted = frozenset(outputs) - {"log_probs"}
    if not wanted:
        return TokenStats(log_probs)
    moments = _VocabParallelMoments.apply(z, target, tp_group, vocab_start, vocab_size, ignore_index, wanted)
    return TokenStats(log_probs, *moments)
