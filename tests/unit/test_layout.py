"""The Megatron rank layout is a pure function of (world, tp, cp, pp): checked here without processes."""

import itertools

import pytest

from mtk.parallel.layout import Layout, LayoutError


def test_design_example_world16_tp2_pp4():
    layout = Layout(world_size=16, tp_size=2, pp_size=4)
    assert layout.dp_size == 2
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert layout.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert layout.pp_groups() == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert layout.model_parallel_groups() == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert layout.embedding_groups() == [[0, 12], [1, 13], [2, 14], [3, 15]]


def test_megatron_core_context_parallel_example_world16_tp2_cp2_pp2():
    """Megatron-Core's order, TP fastest, then CP, then DP, then PP (its parallel_state docstring's example)."""
    layout = Layout(world_size=16, tp_size=2, pp_size=2, cp_size=2)
    assert (layout.dp_size, layout.replica_size) == (2, 4)
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert layout.cp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert layout.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert layout.replica_groups() == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert layout.pp_groups() == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert layout.model_parallel_groups() == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    assert layout.batch_groups() == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]  # one per DP rank
    for rank in range(16):
        c = layout.coords(rank)
        assert layout.rank_at(c.tp_rank, c.dp_rank, c.pp_rank, c.cp_rank) == rank
        for kind in ("cp", "dp", "replica"):  # the ranks that hold the same weights agree on tp and pp
            assert {(layout.coords(o).tp_rank, layout.coords(o).pp_rank) for o in layout.group_of(kind, rank)} == {
                (c.tp_rank, c.pp_rank)
            }
    sizes = (("tp", 8, 2), ("cp", 8, 2), ("dp", 8, 2), ("replica", 4, 4), ("pp", 8, 2), ("batch", 2, 8))
    for kind, count, size in sizes:
        _check_partition(layout, kind, count, size)
    with pytest.raises(LayoutError, match="not divisible by tp\\*cp\\*pp = 2\\*3\\*1 = 6"):
        Layout(world_size=8, tp_size=2, cp_size=3)


def test_without_context_parallelism_the_replica_group_is_the_data_parallel_group():
    layout = Layout(world_size=8, tp_size=2)
    assert layout.replica_groups() == layout.dp_groups() and layout.cp_groups() == [[r] for r in range(8)]
    assert layout.batch_groups() == layout.model_parallel_groups()


def test_megatron_core_expert_parallel_example_world16_tp2_cp2_ep4():
    """Megatron-Core's expert grid with the experts' TP equal to TP (tp-ep-dp-pp): EP runs over consecutive
    replica ranks; the expert replicas (expert-data-parallel) are the ranks at the same place in each run."""
    layout = Layout(world_size=16, tp_size=2, cp_size=2, ep_size=4)
    assert layout.ep_groups() == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert layout.expert_replica_groups() == [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]]
    _check_partition(layout, "ep", 4, 4)
    _check_partition(layout, "expert_replica", 8, 2)
    assert Layout(world_size=4, tp_size=2).ep_groups() == [[0], [2], [1], [3]]  # ep = 1: every rank its own
    with pytest.raises(LayoutError, match="expert parallelism 3 does not divide the 4 ranks that hold the same dense"):
        Layout(world_size=8, tp_size=2, ep_size=3)


def _check_partition(layout: Layout, kind: str, n_groups: int, group_len: int) -> None:
    groups = layout.groups(kind)
    assert len(groups) == n_groups
    assert all(len(g) == group_len for g in groups)
    members = sorted(itertools.chain.from_iterable(groups))
    assert members == list(range(layout.world_size)), f"{kind}: every rank in exactly one group"


SEED_CASES = [(w, 8, pp) for w in (64, 96, 128, 160, 192, 224) for pp in (4, 8)]


@pytest.mark.parametrize("world,tp,pp", SEED_CASES)
def test_large_layouts(world, tp, pp):
    if world % (tp * pp):
        with pytest.raises(LayoutError, match="not divisible by tp\\*pp"):
            Layout(world_size=world, tp_size=tp, pp_size=pp)
        return
    layout = Layout(world_size=world, tp_size=tp, pp_size=pp)
    dp = world // (tp * pp)
    assert layout.dp_size == dp
    _check_partition(layout, "tp", world // tp, tp)
    _check_partition(layout, "dp", world // dp, dp)
    _check_partition(layout, "pp", world // pp, pp)
    _check_partition(layout, "mp", dp, tp * pp)
    for rank in range(world):
        c = layout.coords(rank)
        assert layout.rank_at(c.tp_rank, c.dp_rank, c.pp_rank) == rank
        # TP groups are consecutive ranks (one node); PP groups stride by tp*dp.
        assert layout.group_of("tp", rank) == list(range(rank - c.tp_rank, rank - c.tp_rank + tp))
        assert layout.group_of("pp", rank) == [rank - c.pp_rank * tp * dp + p * tp * dp for p in range(pp)]
        # Members of one group agree on every coordinate except the one the group spans.
        for other in layout.group_of("dp", rank):
            o = layout.coords(other)
            assert (o.tp_rank, o.pp_rank) == (c.tp_rank, c.pp_rank)
        emb = layout.group_of("embedding", rank)
        assert (rank in emb) == (c.pp_rank in (0, pp - 1))


def test_single_process_and_pp1_embedding():
    layout = Layout(world_size=1)
    assert layout.groups("tp") == [[0]] and layout.embedding_groups() == [[0]]
    assert Layout(world_size=4, tp_size=2).embedding_groups() == [[0], [1], [2], [3]]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(world_size=6, tp_size=4), "world size 6 is not divisible by tp\\*pp = 4\\*1 = 4"),
        (dict(world_size=8, tp_size=0), "tp_size must be a positive integer"),
        (dict(world_size=8, pp_size=-1), "pp_size must be a positive integer"),
        (dict(world_size=0), "world_size must be a positive integer"),
        (dict(world_size=8, tp_size=2.0), "tp_size must be a positive integer"),
    ],
)
def test_invalid_layouts_get_one_clear_line(kwargs, message):
    with pytest.raises(LayoutError, match=message) as err:
        Layout(**kwargs)
    assert "\n" not in str(err.value)


def test_coords_out_of_range():
    with pytest.raises(LayoutError, match="outside the world"):
        Layout(world_size=4).coords(4)
