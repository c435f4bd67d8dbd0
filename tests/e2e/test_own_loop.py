"""A user's own accelerate loop (tests/e2e/own_loop_script.py) logs plain accelerate's losses and gradient norm at
TP2xPP2 and under sequence parallelism (its batches padded to odd lengths, no ``num_items_in_batch``: the pipeline
returns the batch's token mean, sequence parallelism pads inside), and at TP2xPP2xDP2 equals plain accelerate's
2-process data parallelism."""

import json
import os
import sys

import pytest
import torch

from mtk.testing import assert_close_rel
from tests.e2e.launch import ROOT, accelerate_launch, free_port, run_command

SCRIPT = "tests/e2e/own_loop_script.py"


def _result(output: str) -> dict:
    return json.loads([line for line in output.splitlines() if line.startswith('{"losses"')][-1])


@pytest.fixture(scope="module")
def plain() -> dict[int, dict]:
    """accelerate's own runs: one process, and two processes (DDP on CPU) started by torchrun."""
    one = run_command([sys.executable, SCRIPT], cwd=ROOT, timeout=300, check=True)
    two = run_command(
        ["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), SCRIPT],
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "ACCELERATE_USE_CPU": "true"},
    )
    assert two.returncode == 0, two.stderr[-3000:]
    return {1: _result(one.stdout), 2: _result(two.stdout)}


@pytest.mark.parametrize("layout, dp", [("tp2_pp2", 1), ("tp2_sp", 1), ("tp2_pp2_dp2", 2)])
def test_a_users_own_loop_logs_plain_accelerates_numbers(plain, layout, dp):
    ours = _result(accelerate_launch(SCRIPT, layout, "--mtk").stdout)
    expected = plain[dp]
    assert len(ours["losses"]) == len(expected["losses"])
    for step, (loss, reference) in enumerate(zip(ours["losses"], expected["losses"]), start=1):
        assert_close_rel(loss, reference, f"{layout} step {step} loss")
    assert_close_rel(ours["grad_norm"], expected["grad_norm"], f"{layout} final grad norm")


def test_the_deepspeed_jsons_scheduler_runs_its_steps_over_the_data_parallel_replicas(tmp_path):
    """``DummyScheduler(total_num_steps=T)``: accelerate fills the JSON's scheduler with ``T / num_processes``, a
    replica per process in plain accelerate; at TP 2 (one replica) the schedule ended at half the run and stayed at
    its last rate. The rates are DeepSpeed's own ``WarmupDecayLR`` over T steps."""
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    from tests.e2e.own_loop_script import STEPS

    config = json.loads((ROOT / "ds_configs" / "accelerate_zero2_tp2.json").read_text())
    config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}
    config["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_type": "linear", "total_num_steps": "auto",
                           "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}  # fmt: skip
    (tmp_path / "ds.json").write_text(json.dumps(config))
    yaml = (ROOT / "accelerate_configs" / "tp2_dp2_zero2.yaml").read_text()
    yaml = yaml.replace("ds_configs/accelerate_zero2_tp2.json", str(tmp_path / "ds.json"))
    (tmp_path / "ds.yaml").write_text(yaml.replace("num_processes: 4", "num_processes: 2"))
    ours = _result(accelerate_launch(SCRIPT, str(tmp_path / "ds.yaml"), "--mtk", "--dummies").stdout)
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=1e-3)
    schedule = WarmupDecayLR(optimizer, total_num_steps=STEPS, warmup_min_lr=0, warmup_max_lr=1e-3,
                             warmup_num_steps=1, warmup_type="linear")  # fmt: skip
    expected = []
    for _ in range(STEPS):
        schedule.step()
        expected.append(optimizer.param_groups[0]["lr"])
    assert ours["rates"] == pytest.approx(expected, rel=1e-6), (ours["rates"], expected)
    assert ours["rates"][-2] > 0  # (at half the steps it was 0 from the second step on)
