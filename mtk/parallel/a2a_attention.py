"""Attention over a sequence split across a context-parallel group by all-to-all (DeepSpeed-Ulysses; Megatron's
``cp_comm_type a2a``).

Where ring attention (:mod:`mtk.parallel.ring_attention`) passes key/value blocks round the group, this trades the
split: one all-to-all turns "every head, my tokens" into "my heads, every token" (``[b, h, s, d] -> [b, h/cp,
cp·s, d]``), attention runs over the whole sequence for ``h/cp`` heads, and one all-to-all turns the output back.
Three all-to-alls forward (q, k and v) and one back, four backward, each ``b·h·s·d/cp`` elements per peer —
independent of the sequence's length per rank, unlike the ring's ``cp − 1`` block passes. The heads must split
over CP: ``h`` a multiple of ``cp``; the kv heads are repeated to one per query head first where ``h_kv`` is not.

The whole sequence is in rank order after the exchange (rank 0's tokens, then rank 1's, ...), not in row order;
the mask is built from every token's row index, document and padding, gathered once, so the order does not
matter and the result is exact (the same masked attention as the ring's, computed in one block).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtk.parallel.comm import Group, all_gather, group_size
from mtk.parallel.ring_attention import ring_attention

__all__ = ["all_to_all_attention"]


def _exchange(x: torch.Tensor, group: Group, scatter_heads: bool) -> torch.Tensor:
    """``[b, H, s, d] -> [b, H/cp, cp·s, d]`` (scatter the heads, gather the sequence) or back."""
    size = group_size(group)
    b, heads, seq, d = x.shape
    if scatter_heads:
        parts = x.view(b, size, heads // size, seq, d).permute(1, 0, 2, 3, 4)  # [cp, b, H/cp, s, d]
    else:
        parts = x.view(b, heads, size, seq // size, d).permute(2, 0, 1, 3, 4)  # [cp, b, H, s/cp, d]
    parts = parts.contiguous()
    received = torch.empty_like(parts)
    dist.all_to_all_single(received, parts, group=group)  # [cp (source rank), ...]
    if scatter_heads:
        return received.permute(1, 2, 0, 3, 4).reshape(b, heads // size, size * seq, d)
    return received.permute(1, 0, 2, 3, 4).reshape(b, size * heads, seq // size, d)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, scatter_heads: bool) -> torch.Tensor:
        ctx.group, ctx.scatter_heads = group, scatter_heads
        return _exchange(x, group, scatter_heads)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad.contiguous(), ctx.group, not ctx.scatter_heads), None, None


def all_to_all_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    documents: torch.Tensor,
    key_valid: torch.Tensor,
    cp_group: Group,
    *,
    scaling: float,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole CP group's keys, by all-to-all: ``[b, h, s, d] -> [b, h, s,
    d]``; the arguments are :func:`~mtk.parallel.ring_attention.ring_attention`'s."""
    size = group_size(cp_group)
    heads, kv_heads = query.shape[1], key.shape[1]
    if size == 1:
        return ring_attention(query, key, value, positions, documents, key_valid, None, scaling=scaling)
    if heads % size:
        raise ValueError(f"all-to-all context parallelism splits the heads: {heads} heads over cp = {size}")
    if kv_heads % size:  # one kv head per query head, so that both split alike
        key = key.repeat_interleave(heads // kv_heads, dim=1)  # [b, h, s, d]
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    meta = torch.stack([positions.long(), documents.long(), key_valid.long()])  # [3, b, s]
    whole = all_gather(meta, cp_group, dim=2)  # [3, b, cp·s], rank order, as the exchange leaves the tokens
    q, k, v = (_AllToAll.apply(t, cp_group, True) for t in (query, key, value))  # [b, h/cp, cp·s, d]
    out = ring_attention(q, k, v, whole[0], whole[1], whole[2].bool(), None, scaling=scaling)
    return _AllToAll.apply(out, cp_group, False)  # [b, h, s, d]
