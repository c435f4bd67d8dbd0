"""accelerate's own distributed test scripts, run against ``mtk.Accelerator`` under ``accelerate launch``.

The scripts come from the installed accelerate (``accelerate/test_utils/scripts/``) at test time;
``run_accelerate_script.py`` changes only their ``Accelerator`` import. At TP=1 x DP=2 every check
of ``test_script.py`` and ``test_sync.py`` runs. At TP=2 x DP=2 the checks written for "every
process is a data-parallel replica" cannot hold (a TP group is one replica split over two
processes) and are skipped, each for the reason in ``SKIPPED_AT_TP2``; the rest pass unchanged.
"""

import pytest
from accelerate.utils import is_torchdata_stateful_dataloader_available

from tests.e2e.launch import accelerate_launch

RUNNER = "tests/conformance/run_accelerate_script.py"

SKIPPED_AT_TP2 = {
    "test_script": {
        "training_check": "its reference trains on batch x num_processes samples per step; with TP=2 only "
        "the 2 DP replicas take data, so the global batch is half that (same loss per replica, by design)",
        "test_split_between_processes_tensor": "its data has 2 rows, written for 2 processes: at 4 processes "
        "ranks 2 and 3 get none, with accelerate's own Accelerator too",
    },
    "test_sync": {
        "test_gradient_accumulation_with_opt_and_scheduler": "its reference steps the scheduler num_processes "
        "times per optimizer step; mtk steps a prepared scheduler once per DP replica (dp_size times), since "
        "the TP ranks of a replica are one model (docs/training.md)",
    },
}

# accelerate's own suite runs test_distributed_data_loop only on multi-GPU machines; on CPU these are the
# checks that need what only GPUs give (DDP join) or a package not installed here.
DATA_LOOP_SKIPS = [
    "test_can_join_uneven_inputs",  # Accelerator.join_uneven_inputs: "only supported for multi-GPU training"
    "test_join_can_override_even_batches",
    "test_join_can_override_for_mixed_type_dataloaders",
    "test_join_raises_warning_for_iterable_when_overriding_even_batches",
    "test_join_raises_warning_for_non_ddp_distributed",
]
if not is_torchdata_stateful_dataloader_available():  # accelerate: @require_torchdata_stateful_dataloader
    DATA_LOOP_SKIPS += ["test_stateful_dataloader", "test_stateful_dataloader_save_state"]


def run(script: str, config: str, skip: list[str] = ()) -> str:
    args = (script, "--skip", ",".join(skip)) if skip else (script,)
    out = accelerate_launch(RUNNER, config, *args, check=False, timeout=900)
    log = out.stdout + out.stderr
    assert out.returncode == 0, f"accelerate's {script}.py failed against mtk.Accelerator:\n{log[-4000:]}"
    return log


@pytest.mark.parametrize("script", ["test_script", "test_sync"])
def test_accelerate_script_passes_at_dp2(script):
    log = run(script, "tp1_dp2")
    assert "conformance: skipped" not in log


def test_accelerate_test_script_passes_at_tp2_dp2():
    log = run("test_script", "tp2_dp2", skip=list(SKIPPED_AT_TP2["test_script"]))
    assert "**Breakpoint trigger test**" in log and "Shuffled central dataloader passing." in log


def test_accelerate_test_sync_passes_at_tp2_dp2():
    log = run("test_sync", "tp2_dp2", skip=list(SKIPPED_AT_TP2["test_sync"]))
    assert "gradient accumulation with dataloader break" in log


def test_accelerate_distributed_data_loop_passes_at_dp2():
    log = run("test_distributed_data_loop", "tp1_dp2", skip=DATA_LOOP_SKIPS)
    assert "Test pickling an accelerator" in log and "Test DataLoader with shuffle=True" in log
