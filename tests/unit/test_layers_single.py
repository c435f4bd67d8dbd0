"""Without a process group the parallel layers are their plain torch counterparts (tp = 1)."""

import torch
from torch import nn

from mtk.parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from mtk.parallel.collective_count import count_collectives


def test_tp1_layers_equal_torch_and_issue_no_collectives():
    torch.manual_seed(0)
    lin, emb = nn.Linear(6, 10), nn.Embedding(11, 6, padding_idx=0)
    col, row = ColumnParallelLinear(6, 10, tp_group=None), RowParallelLinear(6, 10, tp_group=None)
    vocab = VocabParallelEmbedding(11, 6, 0, tp_group=None)
    col.load_full(lin.weight, lin.bias)
    row.load_full(lin.weight, lin.bias)
    vocab.load_full(emb.weight)
    x, ids = torch.randn(2, 3, 6), torch.randint(0, 11, (2, 3))
    with count_collectives() as log:
        assert torch.equal(col(x), lin(x)) and torch.equal(row(x), lin(x))
        assert torch.equal(vocab(ids), emb(ids))
    assert log.events == []


def test_same_seed_same_model_at_any_tp_size():
    """reset_parameters initializes the full matrix then slices it: tp=1 and tp=2 share one model."""
    torch.manual_seed(3)
    full = ColumnParallelLinear(4, 8, tp_group=None)
    torch.manual_seed(3)
    reference = nn.Linear(4, 8)
    assert torch.equal(full.weight, reference.weight) and torch.equal(full.bias, reference.bias)


def test_extra_repr_shows_full_shape_and_rank():
    text = repr(ColumnParallelLinear(4, 8, tp_group=None, output_sizes=[4, 4]))
    assert "out_features=8 (local 8)" in text and "tp_rank=0/1" in text and "output_sizes=[4, 4]" in text


def test_sequence_parallel_padding_after_a_call_another_hook_refused_returns_the_output():
    """CP's split runs before SP's padding: where it refused the call, SP's always-called post-hook popped an empty
    list (torch's warning beside mtk's one line)."""
    from mtk.convert.regions import _PadSequence

    pad = _PadSequence(torch.nn.Linear(2, 2), tp_size=2)
    assert pad.after(torch.nn.Linear(2, 2), (), {}, None) is None
