"""The example scripts run as users type them (on the tiny default models)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_load_memory_example_runs_on_a_tiny_model():
    out = subprocess.run(
        [sys.executable, "examples/load_memory.py", "--model", "tiny-llama", "--tp", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "full HF load" in out.stdout and "mtk tp=2 load, rank 1" in out.stdout
