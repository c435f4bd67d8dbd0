"""Schedule orders and stage splits, without processes."""

import pytest

from mtk.pipeline.schedules import bubble_fraction, schedule_order
from mtk.pipeline.stages import stage_layer_counts
from mtk.plans import UnsupportedModelError


def _max_in_flight(order):
    held = peak = 0
    for kind, _ in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8), (4, 2), (3, 3)])
def test_every_micro_batch_runs_forward_then_backward_once(stages, micro):
    for name in ("afab", "1f1b"):
        for stage in range(stages):
            order = schedule_order(name, micro, stage, stages)
            assert sorted(order) == sorted([("F", i) for i in range(micro)] + [("B", i) for i in range(micro)])
            assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(micro))


def test_1f1b_bounds_activations_by_the_stages_after_this_one():
    assert schedule_order("1f1b", 4, 0, 2) == [
        ("F", 0),
        ("F", 1),
        ("B", 0),
        ("F", 2),
        ("B", 1),
        ("F", 3),
        ("B", 2),
        ("B", 3),
    ]
    assert schedule_order("1f1b", 4, 1, 2) == [
        ("F", 0),
        ("B", 0),
        ("F", 1),
        ("B", 1),
        ("F", 2),
        ("B", 2),
        ("F", 3),
        ("B", 3),
    ]
    for stage in range(4):
        assert _max_in_flight(schedule_order("1f1b", 8, stage, 4)) == 4 - stage
        assert _max_in_flight(schedule_order("afab", 8, stage, 4)) == 8


def test_bubble_fraction_formula():
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(1, 4) == 0


def test_layers_are_split_evenly_unless_asked():
    assert stage_layer_counts(4, 2) == [2, 2]
    assert stage_layer_counts(5, 2) == [3, 2]
    assert stage_layer_counts(7, 4) == [2, 2, 2, 1]
    assert stage_layer_counts(4, 2, (3, 1)) == [3, 1]
    with pytest.raises(UnsupportedModelError, match="fewer than pp = 4 stages"):
        stage_layer_counts(2, 4)
    with pytest.raises(UnsupportedModelError, match="summing to the model's 4 layers"):
        stage_layer_counts(4, 2, (2, 1))
