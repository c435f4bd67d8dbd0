"""The LM head's projection and the vocab-parallel cross-entropy fused, chunk by chunk: no logits kept.

Today's path (:mod:`mtk.parallel.loss`) never gathers the vocabulary, but each rank still holds its
``[tokens, V/tp]`` slice of the logits and, for backward, its softmax: at 32k tokens and a 150k vocabulary that
is ~10 GB per rank in fp32 at TP = 2, more than all the decoder's activations. Here the head's input ``h`` and
weight ``W`` go in, and only per-token numbers are kept:

forward, per chunk of ``c`` tokens: ``z = h_c W^T (+ b)``  [c, V/tp] (freed at once) ->
    this rank's log-sum-exp ``l_r = m_r + log sum_j exp(z_j - m_r)`` and target logit ``z_t`` (0 off this rank);
then, for all tokens at once, the same two all-reduces as the unfused loss (O(tokens)):
    ``m = max_r l_r`` (MAX), ``[sum_r exp(l_r - m), z_t]`` (SUM) -> ``lse = m + log(...)``, ``loss = lse - z_t``.

backward, per chunk: ``z`` again (one more head matmul: the price of not keeping it), ``dz = (exp(z - lse) -
onehot(t)) * dloss``, ``dh_c = dz W``, ``dW += dz^T h_c``. No collective: the input's gradient is summed over TP
by the head's entry into the TP region, as for any column layer. Peak extra memory is one chunk's logits and
its softmax instead of the whole sequence's. The matmuls run in the dtype the forward's ran in (autocast's), the
softmax in at least fp32, and ``dW`` accumulates over several chunks in at least fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mtk.parallel.comm import Group, all_reduce

__all__ = ["AUTO_CHUNK_BYTES", "chunk_tokens_for", "chunked_vocab_parallel_cross_entropy"]

AUTO_CHUNK_BYTES = 256 * 2**20  # a chunk's fp32 logits at most this (and its softmax as much again)


def chunk_tokens_for(local_vocab: int, budget_bytes: int = AUTO_CHUNK_BYTES) -> int:
    """Tokens per chunk whose fp32 ``[tokens, V/tp]`` logits fit ``budget_bytes`` (at least one token)."""
    return max(1, budget_bytes // (4 * max(1, local_vocab)))


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, real_columns: int) -> torch.Tensor:
    """``[c, H] -> [c, V/tp]`` logits in at least fp32 (fp64 stays fp64), TP padding columns at -inf."""
    z = F.linear(h, weight, bias)  # [c, V/tp] in the compute dtype (autocast's in forward)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if real_columns < z.shape[-1]:
        z[:, real_columns:] = float("-inf")  # the padded vocabulary takes no probability mass
    return z


def _logsumexp_(z: torch.Tensor) -> torch.Tensor:
    """``logsumexp(z, -1)`` of ``[c, V/tp]`` logits, overwriting them (one chunk's buffer, not two)."""
    top = z.amax(dim=-1)  # [c]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a row of padding only: -inf stays -inf
    return z.sub_(top[:, None]).exp_().sum(dim=-1).log_().add_(top)


class _ChunkedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, group, vocab_start, vocab_size, ignore_index, chunk):
        # hidden: [N, H] the head's input (in the TP region); weight: [V/tp, H]; target: [N] global ids
        real_columns = max(0, min(weight.shape[0], vocab_size - vocab_start))
        local_target = target - vocab_start  # [N]
        owned = (local_target >= 0) & (local_target < real_columns) & (target != ignore_index)  # [N]
        index = local_target.masked_fill(~owned, 0)  # [N]
        local_lse, target_logit = [], []
        for start in range(0, hidden.shape[0], chunk):
            stop = min(start + chunk, hidden.shape[0])
            z = _chunk_logits(hidden[start:stop], weight, bias, real_columns)  # [c, V/tp]
            target_logit.append(z.gather(-1, index[start:stop, None]).squeeze(-1) * owned[start:stop])  # [c]
            local_lse.append(_logsumexp_(z))  # [c]; -inf where this rank holds only padding
        lse = torch.cat(local_lse) if local_lse else hidden.new_zeros(0, dtype=torch.float32)  # [N]
        picked = torch.cat(target_logit) if target_logit else torch.zeros_like(lse)  # [N]
        top = all_reduce(lse.clone(), group, op=dist.ReduceOp.MAX)  # [N]
        stats = torch.stack([(lse - top).exp(), picked])  # [2, N]
        all_reduce(stats, group)
        lse = top + stats[0].log()  # [N] the full vocabulary's log-sum-exp
        valid = target != ignore_index  # [N]
        loss = (lse - stats[1]).masked_fill(~valid, 0.0)  # [N]
        ctx.save_for_backward(hidden, weight, bias, lse, index, owned, valid)
        ctx.chunk, ctx.real_columns = chunk, real_columns
        # the dtype the head's matmul ran in (autocast's, when on), for the same matmuls in backward
        ctx.matmul_dtype = torch.get_autocast_dtype(hidden.device.type) if _autocast_on(hidden) else None
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, bias, lse, index, owned, valid = ctx.saved_tensors
        dtype = ctx.matmul_dtype or torch.promote_types(hidden.dtype, weight.dtype)
        h_all, w = hidden.to(dtype), weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        scale = grad_loss * valid  # [N] no gradient through ignored tokens
        wants_hidden, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        # several chunks' weight gradients add up in at least fp32; one chunk's is the product itself
        several = hidden.shape[0] > ctx.chunk
        wide = torch.promote_types(weight.dtype, torch.float32) if several else weight.dtype
        accumulator = {"dtype": wide, "device": weight.device}
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None  # [N, H]
        grad_weight = torch.zeros(weight.shape, **accumulator) if wants_weight else None  # [V/tp, H]
        grad_bias = torch.zeros(weight.shape[0], **accumulator) if wants_bias else None  # [V/tp]
        for start in range(0, hidden.shape[0], ctx.chunk):
            stop = min(start + ctx.chunk, hidden.shape[0])
            h = h_all[start:stop]  # [c, H]
            z = _chunk_logits(h, w, b, ctx.real_columns)  # [c, V/tp]
            grad_z = z.sub_(lse[start:stop, None]).exp_()  # [c, V/tp] softmax
            grad_z.scatter_add_(-1, index[start:stop, None], -owned[start:stop, None].to(grad_z.dtype))
            grad_z.mul_(scale[start:stop, None].to(grad_z.dtype))
            grad_z = grad_z.to(dtype)
            if grad_hidden is not None:
                grad_hidden[start:stop] = grad_z.mm(w)  # [c, H]
            if grad_weight is not None and grad_weight.dtype == dtype:
                grad_weight.addmm_(grad_z.t(), h)  # [V/tp, H], in place: no second [V/tp, H] buffer
            elif grad_weight is not None:
                grad_weight.add_(grad_z.t().mm(h))  # a low-precision product, accumulated wider
            if grad_bias is not None:
                grad_bias.add_(grad_z.sum(0))
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def _autocast_on(tensor: torch.Tensor) -> bool:
    device = tensor.device.type
    return torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)  # (not on meta)


def chunked_vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    tp_group: Group,
    *,
    vocab_start: int,
    vocab_size: int,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy ``[...]`` of ``hidden [..., H] @ weight [V/tp, H]^T (+ bias)`` against global
    ``target [...]`` ids, never holding more than one chunk's logits (0 where ``target == ignore_index``).

    Args:
        hidden: the head's input, already in the TP region (every TP rank holds the same tokens).
        weight: this rank's rows of the (padded) vocabulary; ``bias`` its slice or ``None``.
        vocab_start: first global vocabulary row this rank holds; ``vocab_size``: the real vocabulary (rows at or
            past it are TP padding, excluded).
        chunk_tokens: tokens per chunk; default: as many as keep a chunk's fp32 logits within
            :data:`AUTO_CHUNK_BYTES`.
    """
    if hidden.shape[:-1] != target.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and target {tuple(target.shape)} disagree before the last dim")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    chunk = chunk_tokens or chunk_tokens_for(weight.shape[0])
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    flat_target = target.reshape(-1).to(hidden.device)  # [N]
    losses = _ChunkedVocabParallelCrossEntropy.apply(
        flat_hidden, weight, bias, flat_target, tp_group, vocab_start, vocab_size, ignore_index, chunk
    )
    return losses.view(target.shape)
