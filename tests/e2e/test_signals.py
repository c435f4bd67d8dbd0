"""Signals as a terminal and a scheduler send them, and two runs in one --output_dir, on TP=2 runs.

Ctrl-C reaches every process of the foreground job, SLURM signals every process of the job step, and
torchrun (under ``accelerate launch``) puts each worker in a session of its own and forwards what it got, so
each worker gets the signal twice. One Ctrl-C saves the step the ranks agree on, every time, and
``--resume auto`` continues it exactly; a second one stops at once without a traceback or a checkpoint
that looks complete; a SIGTERM during a long evaluation stops it within a batch. A second run into an
``--output_dir`` in use is refused in one line naming the first, and a run killed with SIGKILL leaves
nothing that blocks the requeued job.
"""

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from mtk.checkpoint.integrity import read_verified
from mtk.checkpoint.paths import CheckpointPaths
from mtk.spawn import free_port
from tests.e2e.launch import ROOT, STEP_LINE, accelerate_launch, assert_same_losses, finetune, one_line_error

SAMPLE = Path(ROOT) / "examples" / "data" / "sample.jsonl"


def _launch(out_dir, *args: str) -> subprocess.Popen:
    """``accelerate launch`` of finetune.py at TP=2 in a process group of its own (as a terminal's job)."""
    command = ["accelerate", "launch", "--config_file", "accelerate_configs/tp2.yaml", "--main_process_port",
               str(free_port()), "examples/finetune.py", "--output_dir", str(out_dir), *args]  # fmt: skip
    return subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _read_until(process: subprocess.Popen, text: str) -> tuple[str, float]:
    """The job's output up to the first line holding ``text``, and when that line came."""
    seen = ""
    for line in process.stdout:
        seen += line
        if text in line:
            return seen, time.monotonic()
    raise AssertionError(f"the job ended before {text!r}:\n{seen[-3000:]}")


def _send(process: subprocess.Popen, sig: int) -> None:
    """``sig`` to the launcher's process group and to each worker's (torchrun gives each a session of its own):
    what Ctrl-C in a terminal or SLURM delivers to every process, while torchrun forwards its own."""
    found = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout
    for group in (process.pid, *map(int, found.split())):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, sig)


def _finish(process: subprocess.Popen, seen: str) -> str:
    return seen + process.communicate(timeout=300)[0]


def _no_worker_traceback(output: str) -> None:
    """The only traceback is the launcher's own (torchrun re-raises the signal it got as SignalException)."""
    assert "KeyboardInterrupt" not in output, output[-4000:]
    frames = re.findall(r'File "([^"]+)"', output)
    assert not [f for f in frames if "/mtk/" in f or "examples/" in f or "torch/distributed/distributed_c10d" in f], (
        output[-4000:]
    )


def _mtk_lines(output: str) -> list[str]:
    """mtk's lines about a signal (a progress bar may precede one on its terminal line)."""
    return [line.strip() for line in re.findall(r"mtk: SIG[^\r\n]*", output)]


def test_ctrl_c_saves_the_agreed_step_every_time_and_resume_auto_is_exact(tmp_path):
    """Three Ctrl-C in a row, each resumed with --resume auto (the bug was intermittent), then the rest of the run.

    Each Ctrl-C comes a step or two after the resumed run's first step, so 24 steps leave room for all three: at 8
    the third could arrive after the run had finished (CI saw it once)."""
    steps = 24
    uninterrupted = finetune("tp2", tmp_path / "uninterrupted", "--max_steps", str(steps))
    out_dir, newest = tmp_path / "job", 0
    for attempt in range(3):
        job = _launch(out_dir, "--max_steps", str(steps), "--resume", "auto")
        seen, _ = _read_until(job, f"step {newest + 1} loss")
        _send(job, signal.SIGINT)
        output = _finish(job, seen)
        assert job.returncode == 1 and "SignalException: Process" in output, output[-3000:]  # torchrun's own report
        _no_worker_traceback(output)
        lines = _mtk_lines(output)
        assert len(lines) == 1, output[-4000:]  # one line, no "again": the two deliveries were one request
        line = lines[0]
        saved = int(re.fullmatch(rf"mtk: SIGINT: saved {out_dir}/step_(\d+); continue with --resume auto", line)[1])
        assert saved > newest and read_verified(out_dir / f"step_{saved}").step == saved  # complete, verified
        assert not list(out_dir.glob("*.incomplete")) and not list(out_dir.glob("*.old"))
        logged = {int(s): float(loss) for s, loss in STEP_LINE.findall(output)}
        assert_same_losses(logged, uninterrupted, range(newest + 1, saved + 1), f"Ctrl-C {attempt + 1}")
        newest = saved
    resumed = finetune("tp2", out_dir, "--max_steps", str(steps), "--resume", "auto")
    assert_same_losses(resumed, uninterrupted, range(newest + 1, steps + 1), "resumed after 3 Ctrl-C")


def test_a_second_ctrl_c_stops_at_once_without_a_traceback_or_a_complete_looking_checkpoint(tmp_path):
    """Long steps (one optimizer step over 1,600 examples) so the second Ctrl-C comes while step 2 is running,
    1.5 s after the first (more than the 1 s in which deliveries of one request are one)."""
    data = tmp_path / "data.jsonl"
    data.write_text(SAMPLE.read_text() * 4)
    out_dir = tmp_path / "job"
    job = _launch(out_dir, "--data", str(data), "--grad_accum", "200", "--max_steps", "1000", "--save_every", "1")
    seen, _ = _read_until(job, "step 1 loss")
    time.sleep(0.3)
    _send(job, signal.SIGINT)
    time.sleep(1.5)
    _send(job, signal.SIGINT)
    output = _finish(job, seen)
    assert job.returncode != 0
    _no_worker_traceback(output)
    # the second Ctrl-C reaches each worker directly and as torchrun's SIGTERM, in either order
    stopped = "stopped at once, without saving; --resume auto continues from the newest checkpoint"
    assert _mtk_lines(output) in (
        [f"mtk: SIGINT again: {stopped}"],
        [f"mtk: SIGTERM after SIGINT: {stopped}"],
    ), output[-3000:]
    for folder in out_dir.glob("step_*"):  # step_1 (saved before), perhaps a step_2.incomplete: nothing else
        assert folder.name.endswith(".incomplete") or CheckpointPaths(folder).metadata.is_file(), folder
    read_verified(out_dir / "step_1")  # complete: every file matches its checksum
    assert not (out_dir / "step_2").exists()


def test_sigterm_during_a_long_evaluation_stops_it_within_a_batch_then_saves(tmp_path):
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text(SAMPLE.read_text() * 20)  # 8,000 rows: an evaluation of many seconds
    out_dir = tmp_path / "job"
    job = _launch(out_dir, "--eval_data", str(eval_data), "--eval_every", "2", "--max_steps", "1000")
    seen, start = _read_until(job, "steps 0->1000")
    more, evaluated = _read_until(job, "eval at step 0")  # the whole evaluation at step 0
    seen += more
    more, _ = _read_until(job, "step 2 loss")  # the evaluation at step 2 begins
    seen += more
    time.sleep(1.0)
    _send(job, signal.SIGTERM)
    signalled = time.monotonic()
    output = _finish(job, seen)
    stopped_in, full = time.monotonic() - signalled, evaluated - start
    _no_worker_traceback(output)
    assert _mtk_lines(output) == [
        "mtk: SIGTERM: the evaluation at step 2 stopped early, not logged",
        f"mtk: SIGTERM: saved {out_dir}/step_2; continue with --resume auto",
    ], output[-3000:]
    assert "eval at step 2" not in output  # an interrupted evaluation is not reported as a result
    assert read_verified(out_dir / "step_2").step == 2
    assert stopped_in < full / 2, f"stopped {stopped_in:.1f} s after SIGTERM; a whole evaluation takes {full:.1f} s"


def test_a_second_run_into_an_output_dir_in_use_is_refused_and_a_killed_run_blocks_nothing(tmp_path):
    first = _launch(tmp_path, "--max_steps", "100000", "--save_every", "1")
    seen, _ = _read_until(first, "step 2 loss")
    workers = subprocess.run(["pgrep", "-P", str(first.pid)], capture_output=True, text=True).stdout.split()
    second = accelerate_launch("finetune.py", "tp2", "--output_dir", str(tmp_path), "--resume", "auto", check=False)
    one_line_error(second, f"--output_dir {tmp_path} is in use by another run (pid ")
    holder = re.search(r"in use by another run \(pid (\d+) on host", second.stderr)[1]
    assert holder in workers, (holder, workers)  # the first run's main process
    assert first.poll() is None, "the first run goes on"
    os.killpg(first.pid, signal.SIGKILL)  # a crash: launcher and workers at once, no chance to unlock
    for pid in map(int, workers):
        os.kill(pid, signal.SIGKILL)
    first.communicate(timeout=60)
    newest = max(int(p.name.split("_")[1]) for p in tmp_path.glob("step_*") if p.name.split("_")[1].isdigit())
    requeued = finetune("tp2", tmp_path, "--resume", "auto", "--max_steps", str(newest + 2), "--save_every", "1")
    assert sorted(requeued) == [newest + 1, newest + 2]


def test_ctrl_c_while_a_script_imports_its_libraries_stops_it_without_a_traceback(tmp_path):
    """A terminal's Ctrl-C in the seconds torch, transformers and mtk take to load printed the KeyboardInterrupt's
    traceback through whichever import was running (found by the bad-input campaign): each script stops quietly
    with the shell's status for SIGINT until run_main takes over."""
    for script in ("finetune.py", "generate.py"):
        process = subprocess.Popen(
            ["python", f"examples/{script}", "--output_dir", str(tmp_path / script)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        time.sleep(0.5)  # inside the imports (several seconds here)
        os.killpg(process.pid, signal.SIGINT)
        output, _ = process.communicate(timeout=60)
        assert process.returncode in (-signal.SIGINT, 130) and "Traceback" not in output, (script, output)
