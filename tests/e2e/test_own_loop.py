"""A user's own accelerate loop (tests/e2e/own_loop_script.py) logs plain accelerate's losses and gradient norm at
TP2xPP2 and under sequence parallelism (its batches padded to odd lengths, no ``num_items_in_batch``: the pipeline
returns the batch's token mean, sequence parallelism pads inside), and at TP2xPP2xDP2 equals plain accelerate's
2-process data parallelism."""

import json
import os
import sys

import pytest

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
