"""``mtk plan``'s predictions held against real runs (docs/plan.md): per-rank memory within 15 %, model state
(weights, gradients, AdamW moments) exact, collectives by kind equal to the counted ones.

Each layout runs the bench's mtk contender (gloo processes, fp32) with the live-byte counter on; the
planner traces the same model on the meta device and composes the layout's memory by arithmetic.
"""

import pytest

from mtk.bench.contenders import BenchSpec
from mtk.bench.plan_check import CHECKED_LAYOUTS, check_ranks, planned_collectives
from mtk.bench.runner import run_bench

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("name", list(CHECKED_LAYOUTS))
def test_plan_matches_the_measured_run(name):
    spec = BenchSpec(steps=1, track_memory=True, **CHECKED_LAYOUTS[name])
    (summary,), _ = run_bench(spec, ["mtk"], 1, progress=lambda line: None, timeout=600)
    assert summary.error is None, summary.error
    checks = check_ranks(spec, summary, "cpu")
    assert len(checks) == spec.tp_size * spec.cp_size * spec.pp_size * spec.dp_size
    for check in checks:
        assert check.state_exact, (check.rank, check.measured_state, check.predicted)
        assert 0.85 <= check.ratio <= 1.15, (check.rank, check.measured_peak, check.predicted)
    assert summary.collectives == planned_collectives(spec, "cpu", stage=0)
