"""Each parallel layer, in real gloo processes, against nn.Linear / nn.Embedding with the same weights.

Every rank builds the full reference from the same seed, loads its shard into the parallel layer,
and compares outputs, input gradients and weight gradients (fp32, relative error <= 1e-5).
"""

import pytest
import torch
from torch import nn

from mtk.parallel import (
    ColumnParallelLinear,
    KVReplicatedColumnLinear,
    ParallelState,
    RowParallelLinear,
    VocabParallelEmbedding,
    share_params_across_tp,
)
from mtk.parallel.async_tp import enter_overlapped, weight_gradients_of
from mtk.parallel.collective_count import count_collectives
from mtk.parallel.comm import split
from mtk.parallel.grads import sync_sequence_parallel_grads
from mtk.testing import assert_close_rel, run_distributed

HIDDEN, FFN, BATCH, SEQ = 16, 24, 3, 8


def _reference_run(module: nn.Module, x_full: torch.Tensor, grad_out_seed: int = 1):
    """Output, input grad, and a fixed upstream gradient for a single-process module."""
    x = x_full.clone().requires_grad_()
    y = module(x)
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(grad_out_seed))
    (y * upstream).sum().backward()
    return y.detach(), x.grad, upstream


def _column_checks(state: ParallelState) -> None:
    group, size = state.tp_group, state.tp_size
    torch.manual_seed(0)
    ref = nn.Linear(HIDDEN, FFN)
    x_full = torch.randn(BATCH, SEQ, HIDDEN)
    y_ref, gx_ref, upstream = _reference_run(ref, x_full)

    # gather_output=True: the user sees the full output.
    col = ColumnParallelLinear(HIDDEN, FFN, tp_group=group, gather_output=True)
    col.load_full(ref.weight, ref.bias)
    x = x_full.clone().requires_grad_()
    y = col(x)
    (y * upstream).sum().backward()
    assert_close_rel(y, y_ref, "column gathered output")
    assert_close_rel(x.grad, gx_ref, "column input grad")
    assert_close_rel(col.weight.grad, col.shard(ref.weight.grad), "column weight grad")
    assert_close_rel(col.bias.grad, col.shard(ref.bias.grad, "bias"), "column bias grad")

    # gather_output=False: this rank's slice of the output columns.
    col = ColumnParallelLinear(HIDDEN, FFN, tp_group=group)
    col.load_full(ref.weight, ref.bias)
    x = x_full.clone().requires_grad_()
    y = col(x)
    (y * split(upstream, group, dim=-1)).sum().backward()
    assert_close_rel(y, split(y_ref, group, dim=-1), "column local output")
    assert_close_rel(x.grad, gx_ref, "column (no gather) input grad")

    # Fused [q, k, v]-style projection: each part is split on its own.
    parts = [8, 8, 8]
    fused = ColumnParallelLinear(HIDDEN, FFN, tp_group=group, output_sizes=parts)
    fused.load_full(ref.weight, ref.bias)
    y = fused(x_full)
    expected = torch.cat([split(part, group, dim=-1) for part in y_ref.split(parts, dim=-1)], dim=-1)
    assert_close_rel(y, expected, "fused column output")
    q_cols = y[..., : 8 // size]
    assert_close_rel(q_cols, split(y_ref[..., :8], group, dim=-1), "fused column q part")


def _row_checks(state: ParallelState) -> None:
    group = state.tp_group
    torch.manual_seed(1)
    ref = nn.Linear(FFN, HIDDEN)
    x_full = torch.randn(BATCH, SEQ, FFN)
    y_ref, gx_ref, upstream = _reference_run(ref, x_full)

    for input_is_parallel in (True, False):
        row = RowParallelLinear(FFN, HIDDEN, tp_group=group, input_is_parallel=input_is_parallel)
        row.load_full(ref.weight, ref.bias)
        x = (split(x_full, group, dim=-1) if input_is_parallel else x_full).clone().requires_grad_()
        y = row(x)
        (y * upstream).sum().backward()
        expected_gx = split(gx_ref, group, dim=-1) if input_is_parallel else gx_ref
        tag = f"row(input_is_parallel={input_is_parallel})"
        assert_close_rel(y, y_ref, f"{tag} output")
        assert_close_rel(x.grad, expected_gx, f"{tag} input grad")
        assert_close_rel(row.weight.grad, row.shard(ref.weight.grad), f"{tag} weight grad")
        assert_close_rel(row.bias.grad, ref.bias.grad, f"{tag} bias grad (added once)")


def _mlp_reference(up: nn.Linear, down: nn.Linear):
    return nn.Sequential(up, nn.GELU(), down)


def _column_row_pair_checks(state: ParallelState) -> dict:
    """Column -> GELU -> Row: exact, and exactly one all-reduce forward and one backward."""
    group = state.tp_group
    torch.manual_seed(2)
    up, down = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
    x_full = torch.randn(BATCH, SEQ, HIDDEN)
    y_ref, gx_ref, upstream = _reference_run(_mlp_reference(up, down), x_full)

    col = ColumnParallelLinear(HIDDEN, FFN, tp_group=group)
    row = RowParallelLinear(FFN, HIDDEN, tp_group=group)
    col.load_full(up.weight, up.bias)
    row.load_full(down.weight, down.bias)
    x = x_full.clone().requires_grad_()
    with count_collectives() as fwd:
        y = row(torch.nn.functional.gelu(col(x)))
    with count_collectives() as bwd:
        (y * upstream).sum().backward()
    assert_close_rel(y, y_ref, "MLP output")
    assert_close_rel(x.grad, gx_ref, "MLP input grad")
    assert_close_rel(col.weight.grad, col.shard(up.weight.grad), "MLP up weight grad")
    assert_close_rel(row.weight.grad, row.shard(down.weight.grad), "MLP down weight grad")
    assert_close_rel(row.bias.grad, down.bias.grad, "MLP down bias grad")
    return {"forward": dict(fwd.counts()), "backward": dict(bwd.counts()), "fwd_bytes": fwd.of("all_reduce")[0].nbytes}


def _sequence_parallel_checks(state: ParallelState) -> dict:
    """The same MLP with activations split along the sequence between blocks."""
    group = state.tp_group
    torch.manual_seed(3)
    up, down = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
    x_full = torch.randn(BATCH, SEQ, HIDDEN)
    y_ref, gx_ref, upstream = _reference_run(_mlp_reference(up, down), x_full)

    col = ColumnParallelLinear(HIDDEN, FFN, tp_group=group, sequence_parallel=True)
    row = RowParallelLinear(FFN, HIDDEN, tp_group=group, sequence_parallel=True)
    col.load_full(up.weight, up.bias)
    row.load_full(down.weight, down.bias)
    mlp = nn.Sequential(col, nn.GELU(), row)
    x = split(x_full, group, dim=1).clone().requires_grad_()  # [b, s/tp, h]
    with count_collectives() as fwd:
        y = mlp(x)
    with count_collectives() as bwd:
        (y * split(upstream, group, dim=1)).sum().backward()
    sync_sequence_parallel_grads(mlp, group)
    assert_close_rel(y, split(y_ref, group, dim=1), "SP output")
    assert_close_rel(x.grad, split(gx_ref, group, dim=1), "SP input grad")
    assert_close_rel(col.weight.grad, col.shard(up.weight.grad), "SP up weight grad")
    assert_close_rel(row.weight.grad, row.shard(down.weight.grad), "SP down weight grad")
    assert_close_rel(row.bias.grad, down.bias.grad, "SP down bias grad after sync")
    return {"forward": dict(fwd.counts()), "backward": dict(bwd.counts())}


def _embedding_checks(state: ParallelState) -> dict:
    group = state.tp_group
    vocab, padding_idx = 37, 3  # 37 is prime: padded at every tp > 1
    torch.manual_seed(4)
    ref = nn.Embedding(vocab, HIDDEN, padding_idx=padding_idx)
    ids = torch.cat([torch.arange(vocab), torch.randint(0, vocab, (26,))]).view(9, 7)  # every id appears
    upstream = torch.randn(*ids.shape, HIDDEN)
    out_ref = ref(ids)
    (out_ref * upstream).sum().backward()

    emb = VocabParallelEmbedding(vocab, HIDDEN, padding_idx, tp_group=group, pad_to_multiple_of=2)
    emb.load_full(ref.weight)
    assert emb.num_embeddings == vocab and emb.num_embeddings_padded % (2 * state.tp_size) == 0
    with count_collectives() as fwd:
        out = emb(ids)
    with count_collectives() as bwd:
        (out * upstream).sum().backward()
    assert_close_rel(out, out_ref, "embedding output")
    assert_close_rel(emb.weight.grad, emb.shard(ref.weight.grad), "embedding weight grad")
    local_pad_rows = emb.weight.grad[max(vocab - emb.vocab_start, 0) :]
    assert torch.all(local_pad_rows == 0), "padded rows never receive gradient"
    return {"forward": dict(fwd.counts()), "backward": dict(bwd.counts()), "padded": emb.num_embeddings_padded}


def _conv1d_checks(state: ParallelState) -> None:
    """HF's Conv1D (GPT-2) stores weights [in, out]: transposed=True keeps that layout, same math."""
    from transformers.pytorch_utils import Conv1D

    group = state.tp_group
    torch.manual_seed(5)
    up, down = Conv1D(FFN, HIDDEN), Conv1D(HIDDEN, FFN)  # Conv1D(nf=out, nx=in)
    nn.init.normal_(up.bias)
    nn.init.normal_(down.bias)
    x_full = torch.randn(BATCH, SEQ, HIDDEN)
    y_ref, gx_ref, upstream = _reference_run(nn.Sequential(up, nn.GELU(), down), x_full)
    fused = ColumnParallelLinear(HIDDEN, FFN, tp_group=group, transposed=True, output_sizes=[8, 16])
    assert fused.weight.shape == (HIDDEN, FFN // state.tp_size)
    fused.load_full(up.weight, up.bias)
    full_out = up(x_full)  # [b, s, FFN]
    expected = torch.cat([split(part, group, dim=-1) for part in full_out.split([8, 16], dim=-1)], dim=-1)
    assert_close_rel(fused(x_full), expected, "fused conv1d column output")

    col = ColumnParallelLinear(HIDDEN, FFN, tp_group=group, transposed=True)
    row = RowParallelLinear(FFN, HIDDEN, tp_group=group, transposed=True)
    assert row.weight.shape == (FFN // state.tp_size, HIDDEN)
    col.load_full(up.weight, up.bias)
    row.load_full(down.weight, down.bias)
    x = x_full.clone().requires_grad_()
    y = row(nn.functional.gelu(col(x)))
    (y * upstream).sum().backward()
    assert_close_rel(y, y_ref, "conv1d MLP output")
    assert_close_rel(x.grad, gx_ref, "conv1d MLP input grad")
    assert_close_rel(col.weight.grad, col.shard(up.weight.grad), "conv1d column weight grad")
    assert_close_rel(col.bias.grad, col.shard(up.bias.grad, "bias"), "conv1d column bias grad")
    assert_close_rel(row.weight.grad, row.shard(down.weight.grad), "conv1d row weight grad")


def _kv_replicated_checks(state: ParallelState) -> dict:
    """tp > kv heads: each rank holds its kv head whole; weight grads are summed over its copies."""
    group, r, tp = state.tp_group, state.tp_rank, state.tp_size
    n_kv, head_dim = tp // 2, 4  # two copies of every kv head
    kv_group = state.tp_subgroup(2)
    torch.manual_seed(6)
    ref = nn.Linear(HIDDEN, n_kv * head_dim)
    x_full = torch.randn(BATCH, SEQ, HIDDEN)
    ups = [torch.randn(BATCH, SEQ, head_dim, generator=torch.Generator().manual_seed(k)) for k in range(tp)]
    layer = KVReplicatedColumnLinear(HIDDEN, n_kv, head_dim, tp_group=group, kv_group=kv_group)
    layer.load_full(ref.weight, ref.bias)
    x = x_full.clone().requires_grad_()
    with count_collectives() as bwd_log:
        y = layer(x)
        (y * ups[r]).sum().backward()
    head = r // 2
    rows = slice(head * head_dim, (head + 1) * head_dim)
    assert_close_rel(y, nn.functional.linear(x_full, ref.weight[rows], ref.bias[rows]), "kv output")
    sharers = [k for k in range(tp) if k // 2 == head]
    grad_w = sum(ups[k].reshape(-1, head_dim).t() @ x_full.reshape(-1, HIDDEN) for k in sharers)
    assert_close_rel(layer.weight.grad, grad_w, "kv weight grad summed over copies")
    assert_close_rel(layer.bias.grad, sum(ups[k].sum((0, 1)) for k in sharers), "kv bias grad")
    w = ref.weight.detach()
    grad_x = sum(ups[k] @ w[(k // 2) * head_dim : (k // 2 + 1) * head_dim] for k in range(tp))
    assert_close_rel(x.grad, grad_x, "kv input grad")
    return dict(bwd_log.counts())


def _shared_param_checks(state: ParallelState) -> None:
    """A replicated per-head norm applied to split heads: its grad is the sum over TP ranks."""
    group = state.tp_group
    torch.manual_seed(7)
    heads, head_dim = 4, 6
    norm_ref = nn.LayerNorm(head_dim)
    nn.init.normal_(norm_ref.weight)
    x_full = torch.randn(BATCH, SEQ, heads, head_dim)
    upstream = torch.randn(BATCH, SEQ, heads, head_dim)
    (norm_ref(x_full) * upstream).sum().backward()
    norm = nn.LayerNorm(head_dim)
    norm.load_state_dict(norm_ref.state_dict())
    share_params_across_tp(norm, ["weight", "bias"], group)
    local = lambda t: split(t, group, dim=2)  # noqa: E731  this rank's heads
    (norm(local(x_full)) * local(upstream)).sum().backward()
    assert list(norm.state_dict()) == ["weight", "bias"], "state-dict names unchanged"
    assert_close_rel(norm.weight.grad, norm_ref.weight.grad, "shared norm weight grad")
    assert_close_rel(norm.bias.grad, norm_ref.bias.grad, "shared norm bias grad")


def _overlapped_entry_checks(state: ParallelState) -> dict:
    """Siblings sharing one entered input (one of them Conv1D-shaped, one used twice): the weight gradients
    computed in the entry while its one all-reduce runs equal nn.Linear's."""
    group = state.tp_group
    torch.manual_seed(3)
    first, second = nn.Linear(HIDDEN, FFN), nn.Linear(HIDDEN, FFN)
    x_full = torch.randn(BATCH, SEQ, HIDDEN)
    x = x_full.clone().requires_grad_()
    up = [torch.randn(BATCH, SEQ, FFN, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3)]
    ((first(x) * up[0]).sum() + (second(x) * up[1]).sum() + (first(x) * up[2]).sum()).backward()

    col = ColumnParallelLinear(HIDDEN, FFN, tp_group=group, copy_input=False)
    col.load_full(first.weight, first.bias)
    conv = ColumnParallelLinear(HIDDEN, FFN, tp_group=group, copy_input=False, transposed=True)
    conv.load_full(second.weight.t(), second.bias)
    mine = x_full.clone().requires_grad_()
    with count_collectives() as forward:
        entered = enter_overlapped(mine, group, [col.weight, conv.weight])
        outputs = [col(entered), conv(entered), col(entered)]
    with count_collectives() as backward:
        sum((y * split(u, group, dim=-1)).sum() for y, u in zip(outputs, up)).backward()
    assert_close_rel(mine.grad, x.grad, "entered input grad")
    assert_close_rel(col.weight.grad, col.shard(first.weight.grad), "deferred weight grad, used twice")
    assert_close_rel(conv.weight.grad, conv.shard(second.weight.grad.t()), "deferred Conv1D weight grad")
    assert_close_rel(col.bias.grad, col.shard(first.bias.grad, "bias"), "bias grad")
    assert weight_gradients_of(entered).compute(col.weight) is None, "nothing left behind"

    # under bf16 autocast the product runs in bf16 as nn.Linear's does; the weight gradient comes back fp32
    first.zero_grad()
    col.zero_grad()
    x = x_full.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # backward outside it, as accelerate runs it
        expected = (first(x).float() * up[0]).sum()
        y = col(enter_overlapped(x_full.clone().requires_grad_(), group, [col.weight]))
    expected.backward()
    assert y.dtype == torch.bfloat16
    (y.float() * split(up[0], group, dim=-1)).sum().backward()
    assert col.weight.grad.dtype == torch.float32
    assert_close_rel(col.weight.grad, col.shard(first.weight.grad), "bf16 deferred weight grad", tol=2e-2)
    return {"forward": forward.counts(), "backward": backward.counts()}


def _all_layer_checks(rank: int, world_size: int) -> dict:
    state = ParallelState.build(tp_size=world_size)
    assert state.tp_size == world_size
    _column_checks(state)
    _row_checks(state)
    _conv1d_checks(state)
    _shared_param_checks(state)
    return {
        "pair": _column_row_pair_checks(state),
        "sp": _sequence_parallel_checks(state),
        "embedding": _embedding_checks(state),
        "kv_backward": _kv_replicated_checks(state),
        "overlapped": _overlapped_entry_checks(state),
    }


@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_layers_match_reference(tp):
    results = run_distributed(_all_layer_checks, world_size=tp)
    for result in results:
        # Megatron's claim: a Column -> Row pair costs one all-reduce forward and one backward.
        assert result["pair"]["forward"] == {"all_reduce": 1}
        assert result["pair"]["backward"] == {"all_reduce": 1}
        assert result["pair"]["fwd_bytes"] == BATCH * SEQ * HIDDEN * 4  # b*s*h fp32 elements
        # Sequence parallel: the all-reduce becomes an all-gather + reduce-scatter each way.
        assert result["sp"]["forward"] == {"all_gather": 1, "reduce_scatter": 1}
        assert result["sp"]["backward"] == {"all_gather": 1, "reduce_scatter": 1}
        assert result["embedding"]["forward"] == {"all_reduce": 1}
        assert result["embedding"]["backward"] == {}
        # input-grad all-reduce over TP + one weight and one bias grad all-reduce over the kv copies
        assert result["kv_backward"] == {"all_reduce": 3}
        # three column products on one entered input: still one all-reduce, in backward only
        assert result["overlapped"] == {"forward": {}, "backward": {"all_reduce": 1}}
        assert result["embedding"]["padded"] == -(-37 // (2 * tp)) * 2 * tp  # next multiple of tp*pad
