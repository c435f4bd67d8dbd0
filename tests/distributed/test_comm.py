"""Each differentiable collective's forward and backward, against its definition."""

import pytest
import torch

from mtk.parallel import comm
from mtk.parallel.collective_count import count_collectives
from mtk.parallel.state import ParallelState
from mtk.testing import assert_close_rel, run_distributed

B, S, H = 2, 8, 12


def _pairs(rank: int, world_size: int) -> dict:
    """Rank k holds ``base * (k + 1)`` and gets upstream grad ``up * (k + 1)``: every expected value is explicit."""
    state = ParallelState.build(tp_size=world_size)
    g, r, n = state.tp_group, state.tp_rank, state.tp_size
    torch.manual_seed(0)
    base, up = torch.randn(B, S, H), torch.randn(B, S, H)  # identical on every rank
    held = [base * (k + 1) for k in range(n)]  # what rank k holds
    ups = [up * (k + 1) for k in range(n)]  # upstream gradient on rank k
    cols, seq = H // n, S // n

    def col(t, k):  # rank k's chunk of the last dim
        return t[..., k * cols : (k + 1) * cols]

    def row(t, k):  # rank k's chunk of the sequence dim
        return t[:, k * seq : (k + 1) * seq]

    cases = {
        # name: (input on this rank, expected output, upstream grad here, expected input grad)
        "copy_to_tp": (base, base, ups[r], sum(ups)),
        "reduce_from_tp": (held[r], sum(held), ups[r], ups[r]),
        "scatter_to_tp": (base, col(base, r), col(ups[r], r), torch.cat([col(ups[k], k) for k in range(n)], -1)),
        "gather_from_tp": (col(base, r), base, ups[r], col(ups[r], r)),
        "scatter_to_sequence": (base, row(base, r), row(ups[r], r), torch.cat([row(ups[k], k) for k in range(n)], 1)),
        "gather_from_sequence": (row(base, r), base, ups[r], row(sum(ups), r)),
        "reduce_scatter_to_sequence": (
            held[r],
            row(sum(held), r),
            row(ups[r], r),
            torch.cat([row(ups[k], k) for k in range(n)], 1),
        ),
    }
    counts = {}
    for name, (x, expected_out, upstream, expected_grad) in cases.items():
        x = x.clone().requires_grad_()
        with count_collectives() as fwd:
            y = getattr(comm, name)(x, g)
        with count_collectives() as bwd:
            (y * upstream).sum().backward()
        assert_close_rel(y, expected_out, f"{name} forward")
        assert_close_rel(x.grad, expected_grad, f"{name} backward")
        counts[name] = (dict(fwd.counts()), dict(bwd.counts()))
    return counts


EXPECTED = {
    "copy_to_tp": ({}, {"all_reduce": 1}),
    "reduce_from_tp": ({"all_reduce": 1}, {}),
    "scatter_to_tp": ({}, {"all_gather": 1}),
    "gather_from_tp": ({"all_gather": 1}, {}),
    "scatter_to_sequence": ({}, {"all_gather": 1}),
    "gather_from_sequence": ({"all_gather": 1}, {"reduce_scatter": 1}),
    "reduce_scatter_to_sequence": ({"reduce_scatter": 1}, {"all_gather": 1}),
}


@pytest.mark.parametrize("tp", [2, 4])
def test_collective_pairs(tp):
    for counts in run_distributed(_pairs, world_size=tp):
        assert counts == EXPECTED


def test_size_one_group_is_a_no_op():
    x = torch.randn(2, 4, 6, requires_grad=True)
    with count_collectives() as log:
        for name in EXPECTED:
            y = getattr(comm, name)(x, None)
            assert y is x, name
    assert log.events == []


def test_split_rejects_indivisible_dims_with_advice():
    with pytest.raises(ValueError, match="must be a multiple of 3"):
        comm._check_divisible(torch.zeros(2, 5), 1, 3)
