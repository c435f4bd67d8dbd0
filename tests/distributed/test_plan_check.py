"""``mtk plan``'s predictions held against real runs (docs/plan.md): per-rank memory within 15 %, model state
(weights, gradients, AdamW moments) exact, collectives by kind equal to the counted ones.

Each layout runs the bench's mtk contender (gloo processes, fp32) with the live-byte counter on; the
planner traces the same model on the meta device and composes the layout's memory by arithmetic.
"""

import pytest

from mtk.bench.contenders import BenchSpec
from mtk.bench.plan_check import CHECKED_LAYOUTS, _request_and_candidate, check_ranks, planned_collectives
from mtk.bench.runner import run_bench

pytestmark = pytest.mark.distributed

EXPERT_TENSORS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize("name", list(CHECKED_LAYOUTS))
def test_plan_matches_the_measured_run(name):
    spec = BenchSpec(steps=1, track_memory=True, **CHECKED_LAYOUTS[name])
    (summary,), _ = run_bench(spec, ["mtk"], 1, progress=lambda line: None, timeout=600, fork_workers=True)
    assert summary.error is None, summary.error
    checks = check_ranks(spec, summary, "cpu")
    assert len(checks) == spec.tp_size * spec.cp_size * spec.pp_size * spec.dp_size
    for check in checks:
        assert check.state_exact, (check.rank, check.measured_state, check.predicted)
        assert 0.85 <= check.ratio <= 1.15, (check.rank, check.measured_peak, check.predicted)
    assert summary.collectives == planned_collectives(spec, "cpu", stage=0)


def _lora_step_collectives(rank: int, world: int, model_name: str, targets: list[str], sp: bool) -> dict:
    """One LoRA forward and backward at TP 2, then the sum of the sequence-parallel and ``tp_shared`` gradients the
    Accelerator does after backward (its ``prepare`` moves the latter there; not a prepared model's checks that the
    ranks share inputs and loss, which the planner leaves out as the bench does): the collectives TP rank 0 issued,
    by kind."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from mtk import Accelerator, ParallelConfig, RunSettings
    from mtk.lora import get_peft_model
    from mtk.models import builtin_config
    from mtk.parallel.collective_count import count_collectives
    from mtk.parallel.grads import sum_tp_shared_grads_at_step, sync_sequence_parallel_grads

    accelerator = Accelerator(
        parallel_config=ParallelConfig(tp_size=2), run_settings=RunSettings(sequence_parallel=sp)
    )
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(builtin_config(model_name)).float()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", target_parameters=targets or None)
    model = get_peft_model(accelerator.parallelize(base), lora, report=lambda *_: None)  # unprepared, as the bench
    sum_tp_shared_grads_at_step(model, accelerator.parallel.tp_group)  # as prepare does
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with count_collectives() as log:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        sync_sequence_parallel_grads(model, accelerator.parallel.tp_group)
    nbytes = log.bytes_by_kind()
    return {kind: {"count": count, "bytes": nbytes[kind]} for kind, count in log.counts().items()}


@pytest.mark.parametrize(
    ("model", "targets", "sp"),
    [("tiny-llama", [], False), ("tiny-llama", [], True), ("tiny-qwen3-moe", EXPERT_TENSORS, False)],
    ids=["llama", "llama-sp", "qwen3-moe-experts"],
)
def test_plan_counts_the_collectives_of_lora_at_tp(model, targets, sp):
    """LoRA at TP 2 as the planner predicts it: each TP-split linear's replicated factor (a column's A, a row's B)
    summed over TP in every backward, the whole factors of experts split over TP once per step (no EP here), the
    frozen embedding's input path without a gradient (one input collective fewer; under SP a gather and a scatter),
    LoRA's frozen norms without one (no q/k norm sum; under SP no sum after backward)."""
    from dataclasses import replace

    from mtk.planner.search import stage_collectives
    from mtk.spawn import run_distributed

    spec = BenchSpec(model=model, tp_size=2, pp_size=1, steps=1, batch=2, seq=16, sequence_parallel=sp)
    request, candidate = _request_and_candidate(spec, "cpu")
    planned = stage_collectives(replace(request, lora_r=4, lora_target_parameters=tuple(targets)), candidate, 0)
    measured = run_distributed(_lora_step_collectives, world_size=2, args=(model, targets, sp))[0]
    assert measured == planned
