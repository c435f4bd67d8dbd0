"""Attention over a sequence split across a context-parallel (CP) group: ring attention, exact.

Each CP rank holds some of the sequence's tokens (any split: the load-balanced one gives rank r chunks ``r`` and
``2·cp−1−r`` of ``2·cp``, so causal work is even) and computes attention for its queries over every rank's keys.
Which key a query may see is decided by each token's *global* position, document and padding, never by where the
token sits in the rank's buffer: ``key position <= query position``, the same document (packed rows: no token
attends across a document boundary), and the key not padding. So the result is the unsplit model's whatever the
split.

Forward (``cp`` steps): the rank computes its queries against the key/value block it holds, folds the block into
a running output with the log-sum-exp rule (online softmax: ``lse = logaddexp(lse, lse_b)``, ``out = out·e^(lse_old
− lse) + out_b·e^(lse_b − lse)``), and passes the block to the next rank while it computes (p2p, overlapped). Only
``q, k, v``, the output and the ``[b, h, s]`` log-sum-exp are kept for backward.

Backward (``cp`` steps, FlashAttention's rule): with ``D = rowsum(dout · out)``, for each block ``p = exp(s − lse)``,
``dv_b += pᵀ dout``, ``ds = p · (dout vᵀ − D)``, ``dq += ds k · scale``, ``dk_b += dsᵀ q · scale``; the block's
``dk, dv`` travel with it round the ring and reach their owner after one more hop. The token metadata (position,
document, padding: ``[b, s]`` integers) is all-gathered once per call instead of travelling.

Grouped-query attention is computed grouped (``[b, kv heads, group, s, d]``): the blocks that travel are the kv
heads', never repeated ones. Scores and softmax run in at least fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtk.parallel.comm import Group, all_gather, group_rank, group_size

__all__ = ["ring_attention"]


class _Ring:
    """Pass a tensor to the next rank of ``group`` while receiving the previous rank's (non-blocking)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        size, rank = group_size(group), group_rank(group)
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)
        self.group = group

    def start(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list]:
        received = torch.empty_like(tensor)
        return received, [
            dist.isend(tensor, self.next, group=self.group),
            dist.irecv(received, self.prev, group=self.group),
        ]


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _allowed(q_meta: torch.Tensor, k_meta: torch.Tensor) -> torch.Tensor:
    """``[b, 1, 1, s, t]`` which keys each query sees, from ``[3, b, s]`` / ``[3, b, t]`` (position, document,
    is-not-padding) metadata."""
    causal = k_meta[0][:, None, :] <= q_meta[0][:, :, None]  # [b, s, t]
    same_document = k_meta[1][:, None, :] == q_meta[1][:, :, None]
    return (causal & same_document & k_meta[2].bool()[:, None, :])[:, None, None]


def _scores(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scaling: float) -> torch.Tensor:
    """``[b, n, g, s, t]`` scaled, masked scores in at least fp32 (``-inf`` where a key is not seen): one buffer,
    which the callers turn into probabilities in place (a block's scores are the ring's largest temporary)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("bngsd,bntd->bngst", q.to(dtype), k.to(dtype))
    return scores.mul_(scaling).masked_fill_(~allowed, float("-inf"))


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` with ``-inf`` (a row that sees nothing) replaced by 0, to subtract safely."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _exp_(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(scores - lse)`` in place: the probabilities, 0 where a key is not seen or a row sees nothing."""
    return scores.sub_(_finite(lse)[..., None]).exp_()


def _share(part: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``exp(part - total)``: a partial softmax's weight in the merged one, 0 where the part saw nothing."""
    finite = torch.isfinite(part)
    return torch.where(finite, torch.exp(part - torch.where(finite, total, torch.zeros_like(total))), 0.0)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, meta, group, scaling):
        # q: [b, n, g, s, d] (n kv heads, g queries each); k, v: [b, n, s, d]; meta: [3, b, s] this rank's tokens
        size = group_size(group)
        ring = _Ring(group) if group is not None and size > 1 else None
        metas = all_gather(meta[None], group, dim=0)  # [cp, 3, b, s]: every rank's tokens
        rank = group_rank(group)
        dtype = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape, dtype=dtype, device=q.device)  # [b, n, g, s, d]
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=dtype, device=q.device)  # [b, n, g, s]
        block = torch.cat([k, v], dim=-1).contiguous()  # [b, n, t, 2d]: what travels
        for step in range(size):
            requests: list = []
            if ring is not None and step < size - 1:
                incoming, requests = ring.start(block)
            k_b, v_b = block.split(k.shape[-1], dim=-1)
            scores = _scores(q, k_b, _allowed(meta, metas[(rank - step) % size]), scaling)  # [b, n, g, s, t]
            top = scores.amax(dim=-1)  # [b, n, g, s]
            weights = _exp_(scores, top)  # [b, n, g, s, t], unnormalized, in the scores' buffer
            total = weights.sum(dim=-1)  # [b, n, g, s]; 0 where the row sees nothing in this block
            block_lse = _finite(top) + total.log()  # -inf where total is 0
            block_out = torch.einsum("bngst,bntd->bngsd", weights, v_b.to(dtype))
            block_out.div_(torch.where(total > 0, total, torch.ones_like(total))[..., None])
            merged = torch.logaddexp(lse, block_lse)  # [b, n, g, s]
            out = out * _share(lse, merged)[..., None] + block_out * _share(block_lse, merged)[..., None]
            lse = merged
            if requests:
                _wait(requests)
                block = incoming
        ctx.save_for_backward(q, k, v, meta, metas, out, lse)
        ctx.group, ctx.scaling = group, scaling
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, meta, metas, out, lse = ctx.saved_tensors
        group, scaling = ctx.group, ctx.scaling
        size, rank = group_size(group), group_rank(group)
        ring = _Ring(group) if group is not None and size > 1 else None
        dtype = out.dtype
        grad_out = grad_out.to(dtype)  # [b, n, g, s, d]
        delta = (grad_out * out).sum(-1)  # [b, n, g, s]
        q32 = q.to(dtype)
        grad_q = torch.zeros_like(q32)
        d = k.shape[-1]
        block = torch.cat([k, v], dim=-1).contiguous()  # [b, n, t, 2d]
        grads = torch.zeros(block.shape, dtype=dtype, device=block.device)  # dk, dv of the block held
        for step in range(size):
            requests: list = []
            if ring is not None and step < size - 1:
                incoming, requests = ring.start(block)
            k_b, v_b = (t.to(dtype) for t in block.split(d, dim=-1))
            scores = _scores(q, k_b, _allowed(meta, metas[(rank - step) % size]), scaling)
            p = _exp_(scores, lse)  # [b, n, g, s, t], in the scores' buffer
            grad_v = torch.einsum("bngst,bngsd->bntd", p, grad_out)
            ds = torch.einsum("bngsd,bntd->bngst", grad_out, v_b).sub_(delta[..., None]).mul_(p)  # dp -> ds
            grad_q += torch.einsum("bngst,bntd->bngsd", ds, k_b) * scaling
            grad_k = torch.einsum("bngst,bngsd->bntd", ds, q32) * scaling
            grads += torch.cat([grad_k, grad_v], dim=-1)
            if ring is not None:  # the block's gradients go where the block goes; after the last step, home
                grads_in, grad_requests = ring.start(grads)
                _wait(requests + grad_requests)
                grads = grads_in
                if step < size - 1:
                    block = incoming
        grad_k, grad_v = grads.split(d, dim=-1)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None


def ring_attention(
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
    """Attention of this rank's queries over the whole CP group's keys: ``[b, h, s, d]`` -> ``[b, h, s, d]``.

    Args:
        query: ``[b, h, s, d]`` this rank's tokens' queries; ``key``, ``value``: ``[b, h_kv, s, d]`` (``h`` a
            multiple of ``h_kv``).
        positions: ``[b, s]`` each token's position in the whole (unsplit) row; ``documents``: ``[b, s]`` its
            document (one per packed example, any integers); ``key_valid``: ``[b, s]`` False for padding.
        cp_group: the context-parallel group (every rank passes the same ``b``, ``s``).
        scaling: the scores' factor (HF's ``module.scaling``, usually ``d ** -0.5``).
    """
    b, heads, s, d = query.shape
    kv_heads = key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} kv heads")
    grouped = query.view(b, kv_heads, heads // kv_heads, s, d)  # [b, n, g, s, d]
    meta = torch.stack([positions.long(), documents.long(), key_valid.long()])  # [3, b, s]
    out = _RingAttention.apply(grouped, key, value, meta, cp_group, scaling)  # [b, n, g, s, d]
    return out.reshape(b, heads, s, d)
