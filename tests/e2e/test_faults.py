"""kill -9 at random moments while a TP=2 run saves a checkpoint every step, as a preempted, requeued
job meets it: every ``step_N`` that survives verifies (all its files match their checksums), and the
job resumed with ``--resume auto`` logs exactly the losses of the run that was never interrupted."""

import contextlib
import os
import random
import signal
import subprocess
import time

from mtk.checkpoint.integrity import read_verified
from mtk.spawn import free_port
from tests.e2e.launch import ROOT, assert_same_losses, finetune


def _launch(out_dir, *extra) -> subprocess.Popen:
    command = ["accelerate", "launch", "--config_file", "accelerate_configs/tp2.yaml", "--main_process_port",
               str(free_port()), "examples/finetune.py", "--max_steps", "6", "--save_every", "1",
               "--output_dir", str(out_dir), *extra]  # fmt: skip
    # its own process group: kill -9 reaches the launcher and every worker at once, like a node going away
    return subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _kill_during_a_save(process: subprocess.Popen, after_step: int, delay: float) -> None:
    for line in process.stdout:
        if f"step {after_step} loss" in line:
            break
    time.sleep(delay)
    with contextlib.suppress(ProcessLookupError):  # (it may have finished first)
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)


def _surviving_checkpoints(out_dir) -> list[int]:
    steps = []
    for folder in sorted(out_dir.glob("step_*")):
        if folder.name.endswith((".incomplete", ".old")):
            continue
        steps.append(read_verified(folder).step)  # raises if any file is missing, short or altered
    return steps


def test_kill_9_during_saves_then_resume_auto_is_exact(llama_tp2, tmp_path):
    rng = random.Random(0)
    out_dir = tmp_path / "job"
    for attempt in range(2):  # preempted twice, at a random moment right after a step (inside its save)
        extra = ("--resume", "auto") if attempt else ()
        newest = _surviving_checkpoints(out_dir)[-1] if attempt else 0
        _kill_during_a_save(_launch(out_dir, *extra), after_step=newest + 2, delay=rng.uniform(0.0, 0.2))
        assert _surviving_checkpoints(out_dir)[-1] > newest, "the step before the kill was saved"
    done = _surviving_checkpoints(out_dir)[-1]
    resumed = finetune("tp2", out_dir, "--max_steps", "6", "--save_every", "1", "--resume", "auto")
    assert_same_losses(resumed, llama_tp2.losses, range(done + 1, 7), "resumed after two kill -9")
