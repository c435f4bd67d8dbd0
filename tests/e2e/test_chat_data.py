"""Chat data at every layout: the loss of a step is the mean over every labelled token of the global batch.

Conversations vary 13x in length and some micro-batches are nearly all masked (a long prompt, a one-word
answer), so a mean of micro-batch means (or of DP replicas' means) would differ from the token mean by
far more than the bar. TP=2 x PP=2 x DP=2 with gradient accumulation must log the single-process
run's losses (fp32, <= 1e-5) for the same global batch, packed and padded, and the same evaluation
loss (30 conversations: 15 per DP replica, filled up to whole batches with fully masked examples; the
pipeline runs its forward-only schedule).
"""

import re

import pytest

from tests.e2e.launch import accelerate_launch, assert_same_losses, step_losses

STEPS = 4


def _chat_run(layout: str, out_dir, chat_setup, batch_size: int, *extra: str) -> tuple[dict, dict]:
    out = accelerate_launch(
        "finetune.py", layout, "--output_dir", str(out_dir), "--model", str(chat_setup.model),
        "--data", str(chat_setup.data), "--eval_data", str(chat_setup.eval_data), "--eval_every", "2",
        "--seq_len", "256", "--grad_accum", "2", "--batch_size", str(batch_size), "--max_steps", str(STEPS),
        "--lr", "1e-3", *extra,
    )  # fmt: skip
    evals = {
        int(step): float(loss) for step, loss in re.findall(r"eval at step (\d+): loss (\S+)", out.stdout + out.stderr)
    }
    return step_losses(out), evals


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_tp2_pp2_dp2_with_accumulation_logs_the_single_process_token_mean(chat_setup, tmp_path, packing):
    extra = ("--packing",) if packing else ()
    single, single_eval = _chat_run("tp1", tmp_path / "tp1", chat_setup, 8, *extra)  # global batch 8 x 2 steps
    parallel, parallel_eval = _chat_run("tp2_pp2_dp2", tmp_path / "tp2_pp2_dp2", chat_setup, 4, *extra)  # 4 x 2 x 2
    assert_same_losses(parallel, single, range(1, STEPS + 1), "tp2_pp2_dp2 vs tp1")
    assert_same_losses(parallel_eval, single_eval, range(2, STEPS + 1, 2), "eval, tp2_pp2_dp2 vs tp1")
