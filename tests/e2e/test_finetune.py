"""``accelerate launch --config_file accelerate_configs/<layout>.yaml examples/finetune.py`` as users type it.

Losses are printed at full precision and compared across layouts: the same seed gives the same
model and the same global batches, so TP=2, TP=2 x DP=2, gradient accumulation and a resumed run
must reproduce the single-process losses (fp32, relative error <= 1e-5).
"""

import json
import shutil
from pathlib import Path

import pytest

from tests.e2e.launch import accelerate_launch, assert_same_losses, finetune, one_line_error, step_losses


def launch(config: str, *args: str, processes_ok: bool = True, launcher_args: tuple = ()):
    return accelerate_launch("finetune.py", config, *args, launcher_args=launcher_args, check=processes_ok)


losses = step_losses


@pytest.fixture(scope="module")
def tp2_run(llama_tp2):
    """The shared TP=2 reference run (tests/e2e/conftest.py): 6 steps, checkpoints at 3 and 6."""
    return llama_tp2.dir, llama_tp2.losses


def test_tp2_trains_logs_and_checkpoints(tp2_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out_dir, run = tp2_run
    assert sorted(run) == [1, 2, 3, 4, 5, 6]
    assert run[6] < run[1], "the loss falls"
    events = EventAccumulator(str(out_dir / "runs"))
    events.Reload()
    tags = events.Tags()["scalars"]
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s"):
        assert tag in tags, tags
    logged = {e.step: e.value for e in events.Scalars("train/loss")}
    assert_same_losses(logged, run, range(1, 7))
    step3 = out_dir / "step_3"
    assert sorted(p.name for p in (step3 / "model").iterdir()) == ["tp00-pp00.safetensors", "tp01-pp00.safetensors"]
    assert (step3 / "optimizer" / "tp01-pp00.safetensors").exists() and (step3 / "scheduler.pt").exists()
    assert sorted(p.name for p in (step3 / "rng").iterdir()) == ["rank00000.pt", "rank00001.pt"]
    meta = json.loads((step3 / "metadata.json").read_text())
    assert meta["topology"] == {"world": 2, "tp": 2, "pp": 1, "dp": 1}
    assert meta["step"] == 3 and set(meta["versions"]) >= {"mtk", "torch", "transformers", "accelerate"}
    assert not list(out_dir.glob("*.incomplete")), "no half-written checkpoint left behind"


def test_fp16_on_cpu_runs_as_accelerate_runs_it(tp2_run, tmp_path):
    """accelerate accepts fp16 on CPU and trains in fp32 there (no autocast, no scaler); mtk says so."""
    out = launch("tp2", "--max_steps", "1", "--output_dir", str(tmp_path), launcher_args=("--mixed_precision", "fp16"))
    assert "mtk: mixed_precision=fp16 on cpu: accelerate runs no fp16 autocast" in out.stdout + out.stderr
    assert losses(out)[1] == tp2_run[1][1]


def test_tp1_and_tp2_log_the_same_losses(tp2_run, llama_tp1):
    _, tp2 = tp2_run
    assert_same_losses(tp2, llama_tp1.losses, range(1, 7))


def test_resume_from_step_3_continues_exactly(tp2_run, tmp_path):
    out_dir, uninterrupted = tp2_run
    resumed = losses(
        launch("tp2", "--max_steps", "6", "--output_dir", str(tmp_path), "--resume", str(out_dir / "step_3"))
    )
    assert sorted(resumed) == [4, 5, 6]
    assert_same_losses(resumed, uninterrupted, [4, 5, 6])


def test_tp2_dp2_equals_tp1_at_the_same_global_batch(llama_tp1, tmp_path):
    """Batch 4 per replica over 2 replicas against the TP=1 run's batch 8."""
    tp2_dp2 = finetune("tp2_dp2", tmp_path, "--max_steps", "6", "--batch_size", "4")
    assert_same_losses(tp2_dp2, llama_tp1.losses, range(1, 7))


def test_gradient_accumulation_equals_the_larger_batch(tp2_run, tmp_path):
    _, batch8 = tp2_run
    accumulated = losses(
        launch("tp2", "--batch_size", "4", "--grad_accum", "2", "--max_steps", "6", "--output_dir", str(tmp_path))
    )
    assert_same_losses(accumulated, batch8, range(1, 7))


def test_gradient_accumulation_equals_the_larger_batch_across_epochs(tmp_path):
    """28 examples: an epoch is 3 steps of 8 (4 left over) or 7 micro-batches of 4, of which the last, past the
    last whole step, is not read. The 2-step accumulation windows then hold the same examples as the batches of 8,
    epoch after epoch, and each window is one optimizer step (accelerate's own rule would step at every
    micro-batch of an epoch's last window: its loader has ended once the window is read)."""
    rows = (Path(__file__).resolve().parents[2] / "examples" / "data" / "sample.jsonl").read_text().splitlines()
    data = tmp_path / "small.jsonl"
    data.write_text("\n".join(rows[:28]) + "\n")
    common = ("--data", str(data), "--max_steps", "7", "--warmup_steps", "1")
    batch8 = finetune("tp1", tmp_path / "batch8", *common, "--batch_size", "8")
    accumulated = finetune("tp2", tmp_path / "accum", *common, "--batch_size", "4", "--grad_accum", "2")
    assert_same_losses(accumulated, batch8, range(1, 8))


def test_bf16_trains(tmp_path):
    out = launch(
        "tp2", "--max_steps", "15", "--output_dir", str(tmp_path), launcher_args=("--mixed_precision", "bf16")
    )
    run = losses(out)
    assert run[15] < run[1] - 0.3, run


def _yaml(tmp_path: Path, processes: int, tp: int) -> str:
    path = tmp_path / f"p{processes}_tp{tp}.yaml"
    path.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MEGATRON_LM\nnum_machines: 1\n"
        f"num_processes: {processes}\nmachine_rank: 0\nmixed_precision: 'no'\nmegatron_lm_config:\n"
        f"  megatron_lm_tp_degree: {tp}\nrdzv_backend: static\nsame_network: true\nuse_cpu: false\n"
    )
    return str(path)


def test_bad_input_is_one_clear_line(tmp_path):
    out = launch(_yaml(tmp_path, 3, 3), "--max_steps", "1", "--output_dir", str(tmp_path), processes_ok=False)
    one_line_error(out, "num_attention_heads = 4 is not divisible by tp = 3; valid tp sizes for this model: [1, 2, 4]")
    out = launch(_yaml(tmp_path, 3, 2), "--max_steps", "1", "--output_dir", str(tmp_path), processes_ok=False)
    one_line_error(out, "world size 3 is not divisible by tp*pp = 2*1 = 2")
    out = launch(
        "tp2",
        "--max_steps",
        "1",
        "--output_dir",
        str(tmp_path),
        "--resume",
        str(tmp_path / "step_150"),
        processes_ok=False,
    )
    one_line_error(out, f"checkpoint directory {tmp_path / 'step_150'} does not exist")


def test_a_fresh_run_never_mixes_with_an_earlier_runs_checkpoints(llama_tp1, tmp_path):
    """Refused without --resume/--overwrite; --resume auto finds step_6 (a requeued job that is done exits 0,
    one that changes the data options is refused); --overwrite removes the earlier run's checkpoints only."""
    run = tmp_path / "run"
    shutil.copytree(llama_tp1.dir, run)
    (run / "notes.txt").write_text("mine")

    def checkpoint_files():  # (tensorboard's runs/ gets a new event file, the run lock a new owner, every launch)
        files = [p for p in run.rglob("*") if "runs" not in p.relative_to(run).parts and p.name != ".mtk-run.lock"]
        return sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in files)

    before = checkpoint_files()
    out = launch("tp1", "--max_steps", "6", "--output_dir", str(run), processes_ok=False)
    one_line_error(out, f"--output_dir {run} already holds checkpoints of an earlier run (step_3, step_6)")
    assert checkpoint_files() == before, "nothing touched"
    out = launch("tp1", "--max_steps", "6", "--output_dir", str(run), "--resume", "auto")
    assert f"resuming from {run / 'step_6'}" in out.stdout and "nothing left to do" in out.stdout
    assert checkpoint_files() == before, "a finished run is not saved again"
    out = launch(
        "tp1", "--max_steps", "8", "--output_dir", str(run), "--resume", "auto", "--seq_len", "32", processes_ok=False
    )
    one_line_error(out, "this run changes --seq_len 128 -> 32 from the checkpoint it resumes")
    out = launch("tp1", "--max_steps", "1", "--output_dir", str(run), "--overwrite")
    assert "removed step_3, step_6 of an earlier run" in out.stdout
    assert sorted(p.name for p in run.iterdir()) == [".mtk-run.lock", "notes.txt", "runs", "step_1"]  # the lock stays


def test_sigterm_saves_at_the_next_step_and_stops(tmp_path):
    """What a scheduler sends before it kills a job: SIGTERM to every process of the job (SLURM) while the
    launcher forwards its own, so each worker gets two; every rank finishes its step, the run saves a
    complete checkpoint, and no worker is left running."""
    import os
    import signal
    import subprocess

    from mtk.checkpoint.integrity import read_verified
    from mtk.spawn import free_port
    from tests.e2e.launch import ROOT

    launch_args = ["--config_file", "accelerate_configs/tp2.yaml", "--main_process_port", str(free_port())]
    script_args = ["--max_steps", "100000", "--output_dir", str(tmp_path)]
    command = ["accelerate", "launch", *launch_args, "examples/finetune.py", *script_args]
    launcher = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in launcher.stdout:
        seen.append(line)
        if "step 2 loss" in line:
            workers = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout
            for pid in [launcher.pid, *map(int, workers.split())]:
                os.kill(pid, signal.SIGTERM)
            break
    seen.append(launcher.communicate(timeout=300)[0])
    output = "".join(seen)
    saved = [p for p in tmp_path.iterdir() if p.name.startswith("step_")]
    assert len(saved) == 1, output[-3000:]
    assert f"mtk: SIGTERM: saved {saved[0]}; continue with --resume auto" in output
    assert read_verified(saved[0]).step >= 2  # complete, every file matches its checksum
    assert not list(tmp_path.glob("*.incomplete"))


def test_a_non_finite_gradient_stops_the_run_before_it_is_saved(tmp_path):
    """lr 1e30 makes step 2's gradients nan: one line naming the step, and no checkpoint with nan weights."""
    out = launch("tp1", "--lr", "1e30", "--warmup_steps", "0", "--max_steps", "4", "--output_dir", str(tmp_path),
                 processes_ok=False)  # fmt: skip
    one_line_error(out, "step 2: the gradient norm is nan; stopped before non-finite weights are saved")
    assert not list(tmp_path.glob("step_*"))
