"""Ring attention (context parallelism's p2p flavour) equals attention over the unsplit sequence (HF's eager; in fp64
torch's math kernel, as eager's softmax runs in fp32): the
output of every rank's queries and the gradients of its queries, keys and values, at CP = 2 and 4, with grouped
kv heads, packed documents of very different lengths, padding, and the load-balanced split (rank r holds chunks r
and 2·cp−1−r), in fp64 to the last digits and in fp32 within 1e-5."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import eager_attention_forward

from mtk.parallel.a2a_attention import all_to_all_attention
from mtk.parallel.collective_count import count_collectives
from mtk.parallel.ring_attention import ring_attention
from mtk.testing import assert_close_rel, run_distributed

BATCH, HEADS, KV_HEADS, DIM = 2, 4, 2, 8
DOCUMENTS = [[3, 17, 1, 6, 5], [24, 4]]  # per row: packed example lengths; the rest of the row is padding


class _Module:  # what eager_attention_forward reads from the attention module
    num_key_value_groups = HEADS // KV_HEADS
    training = False


def _row_metadata(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``documents [b, S]`` (padding: a document of its own) and ``valid [b, S]``."""
    documents = torch.full((BATCH, seq), -1, dtype=torch.long)
    valid = torch.zeros(BATCH, seq, dtype=torch.bool)
    for row, lengths in enumerate(DOCUMENTS):
        start = 0
        for index, length in enumerate(lengths):
            documents[row, start : start + length] = index
            start += length
        valid[row, :start] = True
    return documents, valid


def _balanced_indices(seq: int, rank: int, cp: int) -> torch.Tensor:
    chunk = seq // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])  # fmt: skip


def _ring_checks(rank: int, cp: int, dtype: torch.dtype, attend=ring_attention, kv_heads: int = KV_HEADS) -> dict:
    seq = 32
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, HEADS, seq, DIM, dtype=dtype, generator=generator)
    k = torch.randn(BATCH, kv_heads, seq, DIM, dtype=dtype, generator=generator)
    v = torch.randn(BATCH, kv_heads, seq, DIM, dtype=dtype, generator=generator)
    upstream = torch.randn(BATCH, HEADS, seq, DIM, dtype=dtype, generator=generator)
    documents, valid = _row_metadata(seq)
    upstream = upstream * valid[:, None, :, None]  # padding queries are never read
    positions = torch.arange(seq).expand(BATCH, seq)
    scaling = DIM**-0.5

    allowed = (positions[:, None, :] <= positions[:, :, None]) & (documents[:, None, :] == documents[:, :, None])
    allowed &= valid[:, None, :]
    allowed |= ~valid[:, :, None]  # a padding query attends to anything (eager's all -inf row would be NaN)
    mask = torch.zeros(BATCH, 1, seq, seq, dtype=dtype).masked_fill(~allowed[:, None], torch.finfo(dtype).min)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    if dtype == torch.float64:  # HF's eager softmax runs in fp32 whatever the dtype: torch's math kernel instead
        expected = F.scaled_dot_product_attention(*ref, attn_mask=allowed[:, None], scale=scaling, enable_gqa=True)
    else:
        module = _Module()
        module.num_key_value_groups = HEADS // kv_heads
        expected, _ = eager_attention_forward(module, *ref, mask, scaling=scaling)  # [b, S, h, d]
        expected = expected.transpose(1, 2)  # [b, h, S, d]
    (expected * upstream).sum().backward()

    mine = _balanced_indices(seq, rank, cp)
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    with count_collectives() as forward:
        out = attend(*local, positions[:, mine], documents[:, mine], valid[:, mine], dist.group.WORLD, scaling=scaling)
    with count_collectives() as backward:
        (out * upstream[:, :, mine]).sum().backward()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    rows = valid[:, mine]
    assert_close_rel(out.transpose(1, 2)[rows], expected[:, :, mine].transpose(1, 2)[rows], "output", tol=tol)
    for name, got, want in zip("qkv", local, ref):
        assert_close_rel(got.grad, want.grad[:, :, mine], f"grad of {name}", tol=tol)
    return {"forward": dict(forward.counts()), "backward": dict(backward.counts())}


@pytest.mark.parametrize("cp,dtype", [(2, torch.float64), (4, torch.float64), (2, torch.float32)])
def test_ring_attention_equals_eager_attention_on_the_whole_sequence(cp, dtype):
    hops = cp - 1  # forward: each k/v block passed on until every rank has seen it; the tokens' metadata gathered once
    for counts in run_distributed(_ring_checks, world_size=cp, args=(dtype,)):
        assert counts["forward"] == {"all_gather": 1, "send": hops, "recv": hops}
        # backward: the blocks again, and their dk/dv with them plus one hop home
        assert counts["backward"] == {"send": 2 * hops + 1, "recv": 2 * hops + 1}


@pytest.mark.parametrize(
    "cp,dtype,kv_heads",
    [(2, torch.float64, 2), (4, torch.float64, 2), (4, torch.float32, 4), (2, torch.float32, 1)],
)
def test_all_to_all_attention_equals_eager_attention_on_the_whole_sequence(cp, dtype, kv_heads):
    """Ulysses: kv heads split over CP where they divide it (2 over 2, 4 over 4), repeated where not (2 over 4, 1)."""
    for counts in run_distributed(_ring_checks, world_size=cp, args=(dtype, all_to_all_attention, kv_heads)):
        assert counts["forward"] == {"all_gather": 1, "all_to_all": 4}  # q, k, v in; the output back
        assert counts["backward"] == {"all_to_all": 4}
