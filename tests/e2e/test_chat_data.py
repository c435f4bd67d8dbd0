"""Chat data at every layout: the loss of a step is the mean over every labelled token of the global batch.

Conversations vary 13x in length and some micro-batches are nearly all masked (a long prompt, a one-word
answer), so a mean of micro-batch means (or of DP replicas' means) would differ from the token mean by
far more than the bar (3.8e-3 at step 1 here). TP=2 x PP=2 x DP=2 with gradient accumulation, and
DeepSpeed ZeRO-2 at TP=2 x DP=2, must log the single-process run's losses (fp32, <= 1e-5) for the same
global batch, packed and padded, and the same evaluation loss (30 conversations: 15 per DP replica,
filled up to whole batches with fully masked examples; the pipeline runs its forward-only schedule).
"""

import re

import pytest

from mtk.spawn import free_port
from tests.e2e.launch import ROOT, STEP_LINE, accelerate_launch, assert_same_losses, run_command

STEPS = 4


def _options(chat_setup, batch_size: int, packing: bool) -> list[str]:
    return [
        "--model", str(chat_setup.model), "--data", str(chat_setup.data), "--eval_data", str(chat_setup.eval_data),
        "--eval_every", "2", "--seq_len", "256", "--grad_accum", "2", "--batch_size", str(batch_size),
        "--max_steps", str(STEPS), "--lr", "1e-3", *(["--packing"] if packing else []),
    ]  # fmt: skip


def _losses(output: str) -> tuple[dict[int, float], dict[int, float]]:
    """The ``step N loss X`` and ``eval at step N: loss X`` lines of a run."""
    steps = {int(step): float(loss) for step, loss in STEP_LINE.findall(output)}
    evals = {int(step): float(loss) for step, loss in re.findall(r"eval at step (\d+): loss (\S+)", output)}
    return steps, evals


def _accelerate(layout: str, out_dir, chat_setup, batch_size: int, packing: bool):
    out = accelerate_launch(
        "finetune.py", layout, "--output_dir", str(out_dir), *_options(chat_setup, batch_size, packing)
    )
    return _losses(out.stdout + out.stderr)


@pytest.fixture(scope="module")
def single(chat_setup, tmp_path_factory):
    """The single-process runs (global batch 8 x 2 accumulation steps), packed and padded."""
    return {
        packing: _accelerate("tp1", tmp_path_factory.mktemp("tp1"), chat_setup, 8, packing)
        for packing in (True, False)
    }


def _assert_same(actual, expected, what: str) -> None:
    (losses, evals), (expected_losses, expected_evals) = actual, expected
    assert_same_losses(losses, expected_losses, range(1, STEPS + 1), what)
    assert_same_losses(evals, expected_evals, range(0, STEPS + 1, 2), f"eval, {what}")  # step 0: before training


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_tp2_pp2_dp2_with_accumulation_logs_the_single_process_token_mean(chat_setup, single, tmp_path, packing):
    parallel = _accelerate("tp2_pp2_dp2", tmp_path, chat_setup, 4, packing)  # 4 x dp 2 x 2 accumulation
    _assert_same(parallel, single[packing], "tp2_pp2_dp2 vs tp1")


def test_deepspeed_zero2_tp2_dp2_logs_the_single_process_token_mean(chat_setup, single, tmp_path):
    command = [
        "deepspeed", "--num_gpus", "4", "--master_port", str(free_port()), "examples/run.py", "--deepspeed",
        "--deepspeed_config", "ds_configs/zero2.json", "--tp", "2", "--output_dir", str(tmp_path),
        *_options(chat_setup, 4, packing=True),
    ]  # fmt: skip
    out = run_command(command, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    _assert_same(_losses(out.stdout + out.stderr), single[True], "deepspeed zero2 tp2 dp2 vs tp1")


@pytest.mark.parametrize(
    "layout, packing",
    [("tp2_cp2", True), ("tp2_cp2", False), ("tp2_cp2_pp2", True)],
    ids=["tp2_cp2-packed", "tp2_cp2-padded", "tp2_cp2_pp2-packed"],
)
def test_context_parallelism_splits_each_sequence_and_logs_the_single_process_token_mean(
    chat_setup, single, tmp_path, layout, packing
):
    """accelerate_configs/tp2_cp2.yaml (megatron_lm_context_parallel_size: 2) and tp2_cp2_pp2.yaml: every row's
    tokens split over two ranks, packed conversations kept apart, padding unattended, through the pipeline's
    micro-batches too: the single-process losses and eval losses."""
    parallel = _accelerate(layout, tmp_path, chat_setup, 8, packing)  # 8 x dp 1 x 2 accumulation
    _assert_same(parallel, single[packing], f"{layout} vs tp1")
