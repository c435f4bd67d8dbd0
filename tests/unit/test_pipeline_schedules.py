"""Schedule orders and stage splits, without processes."""

import pytest

from mtk.pipeline.balance import stage_layer_counts
from mtk.pipeline.schedules import (
    Pass,
    bubble_fraction,
    bubble_overhead,
    peak_in_flight,
    schedule_order,
    simulate,
)
from mtk.rules import UnsupportedModelError


def _max_in_flight(order):
    held = peak = 0
    for step in order:
        held += 1 if step.kind == "F" else -1
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8), (4, 2), (3, 3)])
def test_every_micro_batch_runs_forward_then_backward_once(stages, micro):
    for name in ("afab", "1f1b"):
        for stage in range(stages):
            order = schedule_order(name, micro, stage, stages)
            assert sorted(order) == sorted([Pass("F", i) for i in range(micro)] + [Pass("B", i) for i in range(micro)])
            assert all(order.index(Pass("F", i)) < order.index(Pass("B", i)) for i in range(micro))


def test_1f1b_bounds_activations_by_the_stages_after_this_one():
    assert [step[:2] for step in schedule_order("1f1b", 4, 0, 2)] == [
        ("F", 0),
        ("F", 1),
        ("B", 0),
        ("F", 2),
        ("B", 1),
        ("F", 3),
        ("B", 2),
        ("B", 3),
    ]
    assert [step[:2] for step in schedule_order("1f1b", 4, 1, 2)] == [
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
    assert bubble_fraction(2, 4, 2) == pytest.approx(1 / 9)


@pytest.mark.parametrize("stages,micro,virtual", [(2, 4, 1), (4, 8, 1), (2, 4, 2), (4, 8, 3), (1, 4, 1)])
def test_bubble_overhead_is_idle_over_compute(stages, micro, virtual):
    """``(p - 1) / (v m)``: the simulated step is the compute times ``1 + overhead``; the fraction is its share."""
    overhead = bubble_overhead(stages, micro, virtual)
    assert overhead == pytest.approx((stages - 1) / (virtual * micro))
    assert bubble_fraction(stages, micro, virtual) == pytest.approx(overhead / (1 + overhead))
    if stages > 1:
        name = "interleaved" if virtual > 1 else "1f1b"
        assert simulate(name, stages, micro, virtual).step_s == pytest.approx(2 * micro * (1 + overhead))


@pytest.mark.parametrize("stages,virtual", [(2, 2), (4, 2), (4, 3), (8, 2)])
def test_peak_in_flight_counts_the_schedules_own_order(stages, virtual):
    """1F1B: ``min(m, p - s)``; AFAB: ``m``; interleaved: Megatron's warm-up ``2 (p - s - 1) + (v - 1) p``
    forwards plus one chunk pass (every forward when ``m = p``)."""
    for micro in range(stages, 4 * stages + 1, stages):
        for stage in range(stages):
            assert peak_in_flight("1f1b", micro, stage, stages) == min(micro, stages - stage)
            assert peak_in_flight("afab", micro, stage, stages) == micro
            warmup = micro * virtual if micro == stages else 2 * (stages - stage - 1) + (virtual - 1) * stages
            expected = min(micro * virtual, warmup + 1)
            assert peak_in_flight("interleaved", micro, stage, stages, virtual) == expected
            order = schedule_order("interleaved", micro, stage, stages, virtual)
            assert _max_in_flight(order) == expected


def test_interleaved_runs_every_chunk_of_every_micro_batch_in_megatron_order():
    p, m, v = 2, 4, 2
    for stage in range(p):
        order = schedule_order("interleaved", m, stage, p, v)
        passes = [Pass(kind, i, c) for kind in "FB" for i in range(m) for c in range(v)]
        assert sorted(order) == sorted(passes)
        assert all(order.index(Pass("F", i, c)) < order.index(Pass("B", i, c)) for i in range(m) for c in range(v))
    # forwards: p micro-batches on chunk 0, the same on chunk 1, then the next p; backwards chunk-reversed
    forwards = [step for step in schedule_order("interleaved", m, 0, p, v) if step.kind == "F"]
    assert [(s.chunk, s.micro_batch) for s in forwards] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (0, 2),
        (0, 3),
        (1, 2),
        (1, 3),
    ]
    backwards = [step for step in schedule_order("interleaved", m, 0, p, v) if step.kind == "B"]
    assert [(s.chunk, s.micro_batch) for s in backwards][:4] == [(1, 0), (1, 1), (0, 0), (0, 1)]
    # warm-up: 2 (p - s - 1) + (v - 1) p forwards before the first backward
    assert [step.kind for step in schedule_order("interleaved", m, 0, p, v)][:5] == ["F"] * 4 + ["F"]
    assert [step.kind for step in schedule_order("interleaved", m, 1, p, v)][:3] == ["F", "F", "F"]


@pytest.mark.parametrize("name,virtual", [("afab", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_schedules_run_without_deadlock_and_idle_as_the_formula_says(name, virtual, stages):
    """On paper, with the engine's transfer rules: no deadlock, every receive meets its own message (the
    ring's pp = 2 pair carries both kinds), and with equal pass times the bubble is the formula's."""
    step = stages if name == "interleaved" else 1
    for micro in range(step, 4 * stages + 1, step):
        equal = simulate(name, stages, micro, virtual)
        assert equal.idle[0] == pytest.approx(bubble_fraction(stages, micro, virtual))
        simulate(name, stages, micro, virtual, forward_s=1.0, backward_s=2.5)  # unequal passes: still no deadlock


def test_interleaving_divides_the_bubble():
    one, two = simulate("1f1b", 2, 4), simulate("interleaved", 2, 4, 2)
    assert two.step_s < one.step_s
    assert two.idle[0] == pytest.approx(1 / 9) and one.idle[0] == pytest.approx(1 / 5)


@pytest.mark.parametrize(
    "name,stages,micro,virtual,message",
    [
        ("gpipe", 2, 4, 1, "unknown; use one of 1f1b, afab, interleaved"),
        ("interleaved", 2, 3, 2, "3 micro-batches is not a multiple; use a multiple of 2"),
        ("interleaved", 2, 4, 1, "needs virtual_stages >= 2"),
        ("1f1b", 2, 4, 2, "needs the interleaved schedule"),
    ],
)
def test_bad_schedules_are_one_line(name, stages, micro, virtual, message):
    with pytest.raises(ValueError, match=message):
        schedule_order(name, micro, 0, stages, virtual)


def test_layers_are_split_evenly_unless_asked():
    assert stage_layer_counts(4, 2) == [2, 2]
    assert stage_layer_counts(5, 2) == [3, 2]
    assert stage_layer_counts(7, 4) == [2, 2, 2, 1]
    assert stage_layer_counts(4, 2, (3, 1)) == [3, 1]
    assert stage_layer_counts(8, 4, (1, 3, 2, 2)) == [1, 3, 2, 2]  # pp 2 x 2 virtual stages: one count per chunk
    with pytest.raises(UnsupportedModelError, match="fewer than the 4 pipeline stages"):
        stage_layer_counts(2, 4)
    with pytest.raises(UnsupportedModelError, match="summing to the model's 4 layers"):
        stage_layer_counts(4, 2, (2, 1))


def test_a_batch_the_micro_batches_do_not_divide_splits_as_the_loss_allows():
    """Equal chunks where they exist; a token-weighted loss free to take any sizes keeps the count (61 rows in 8 are
    not one micro-batch of 61); at the interleaved schedule (groups of pp) chunks one row apart for a
    token-weighted loss, one line for a mean of micro-batch means; copies of the last row count for nothing."""
    import pytest
    import torch

    from mtk.errors import ConfigError
    from mtk.pipeline.batches import split_micro_batches, with_ignored_rows

    batch = {"input_ids": torch.arange(12).reshape(6, 2), "labels": torch.arange(12).reshape(6, 2)}
    assert [len(c["input_ids"]) for c in split_micro_batches(batch, 4)] == [2, 2, 2]
    assert [len(c["input_ids"]) for c in split_micro_batches(batch, 4, token_weighted=True, any_sizes=True)] == [
        2,
        2,
        1,
        1,
    ]
    prime = {"input_ids": torch.zeros(61, 2)}
    assert [len(c["input_ids"]) for c in split_micro_batches(prime, 8)] == [61]  # (a mean of means: equal only)
    assert [len(c["input_ids"]) for c in split_micro_batches(prime, 8, token_weighted=True, any_sizes=True)] == [
        8
    ] * 5 + [7] * 3
    three = {k: v[:3] for k, v in batch.items()}
    assert [len(c["input_ids"]) for c in split_micro_batches(three, 4, 2, token_weighted=True)] == [2, 1]
    with pytest.raises(ConfigError, match="does not split into megatron_lm_num_micro_batches = 4, nor into fewer"):
        split_micro_batches(three, 4, 2)
    one = with_ignored_rows({**{k: v[:1] for k, v in batch.items()}, "token_weights": torch.ones(1, 2)}, 1)
    assert one["input_ids"].tolist() == [[0, 1], [0, 1]] and one["labels"].tolist() == [[0, 1], [-100, -100]]
    assert one["token_weights"].tolist() == [[1.0, 1.0], [0.0, 0.0]]
