"""``deepspeed ... examples/run.py --deepspeed --deepspeed_config ds_configs/zeroN.json`` as users type it.

ZeRO partitions over the data-parallel group only (the topology is DeepSpeed's ``mpu``), so ZeRO-1/2/3
at TP=2 x DP=2 reproduce the non-ZeRO losses of the same seed and global
batch (fp32, <= 1e-5). The first DeepSpeed run on a machine compiles a CPU comm op (~1 minute).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mtk.models import build_model
from mtk.testing import assert_close_rel
from tests.e2e.launch import (
    ROOT,
    accelerate_launch,
    assert_checkpoint_whole,
    assert_same_losses,
    deepspeed_run,
    logged,
    one_line_error,
    run_command,
    step_losses,
)


def held(out: subprocess.CompletedProcess) -> tuple[float, float]:
    """Rank 0's parameters and optimizer state as shares of the whole model's parameters (run.py's last line)."""
    found = re.search(r"held by rank 0: (\d+) parameter elements, (\d+) optimizer-state elements", out.stdout)
    assert found, out.stdout[-2000:]
    total = sum(p.numel() for p in build_model("tiny-llama", seed=0).parameters())
    return int(found[1]) / total, int(found[2]) / total


@pytest.fixture(scope="module")
def reference(llama_tp1):
    """Non-ZeRO losses of the same seed, global batch 8 and schedule (6 steps): the shared Accelerate run at TP=1."""
    return llama_tp1.losses


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("zero2")
    out = deepspeed_run(
        4,
        "zero2",
        "--tp",
        "2",
        "--batch_size",
        "4",
        "--max_steps",
        "6",
        "--save_every",
        "3",
        "--output_dir",
        str(out_dir),
    )
    return out_dir, step_losses(out), held(out)


def test_zero2_tp2_dp2_equals_non_zero(reference, zero2_run):
    out_dir, losses, (parameters, optimizer_state) = zero2_run
    # ZeRO-2 keeps this rank's whole TP shard (~1/2; norms replicated) and 1/dp of its Adam moments (2 per element)
    assert 0.5 <= parameters < 0.52 and abs(optimizer_state - parameters) < 0.01, (parameters, optimizer_state)
    for step in range(1, 7):
        assert_close_rel(losses[step], reference[step], f"ZeRO-2 TP2xDP2 loss at step {step}")
    assert (out_dir / "runs").is_dir() and (out_dir / "step_3" / "deepspeed").is_dir()
    assert_checkpoint_whole(out_dir / "step_3")


def test_zero1_tp2_dp2_with_recompute_equals_non_zero(reference, tmp_path):
    """``--gradient_checkpointing`` under DeepSpeed too: recompute changes memory, not the losses."""
    args = ("--tp", "2", "--batch_size", "4", "--max_steps", "6", "--gradient_checkpointing")
    losses = step_losses(deepspeed_run(4, "zero1", *args, "--output_dir", str(tmp_path)))
    for step in range(1, 7):
        assert_close_rel(losses[step], reference[step], f"ZeRO-1 TP2xDP2 (recompute) loss at step {step}")


def test_zero3_tp2_dp2_equals_non_zero_resumes_and_exports(reference, llama_tp1, tmp_path):
    """ZeRO-3 partitions each TP shard over its DP group: the TP=1 non-ZeRO losses, a resume from step 3 that
    continues them exactly, at the same layout and at TP1 x DP4, and a checkpoint in which each rank wrote its own
    partition of its TP shard (nothing gathered), which `mtk export` joins into the weights of the TP=1 run."""
    from safetensors.torch import load_file

    from mtk.checkpoint.meta import read_metadata

    args = ("--tp", "2", "--batch_size", "4", "--max_steps", "6")
    out = deepspeed_run(4, "zero3", *args, "--save_every", "3", "--output_dir", str(tmp_path / "a"))
    first = step_losses(out)
    for step in range(1, 7):
        assert_close_rel(first[step], reference[step], f"ZeRO-3 TP2xDP2 loss at step {step}")
    parameters, optimizer_state = held(out)  # 1/(tp x dp) of the parameters, and of the Adam moments (2 each)
    assert 0.25 <= parameters < 0.27 and abs(optimizer_state - 2 * parameters) < 0.02, (parameters, optimizer_state)
    resumed = step_losses(
        deepspeed_run(4, "zero3", *args, "--output_dir", str(tmp_path / "b"), "--resume", str(tmp_path / "a/step_3"))
    )
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert_close_rel(resumed[step], first[step], f"ZeRO-3 TP2xDP2 loss at step {step} after resume")
    # at another layout: TP1 x DP4 (2 rows per rank: the same global batch), from mtk's pieces of the optimizer
    moved = deepspeed_run(
        4,
        "zero3",
        *("--tp", "1", "--batch_size", "2", "--max_steps", "6", "--output_dir", str(tmp_path / "c")),
        *("--resume", str(tmp_path / "a/step_3")),
    )
    resumed = step_losses(moved)
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert_close_rel(resumed[step], first[step], f"ZeRO-3 loss at step {step} after resuming at TP1 x DP4")
    saved = tmp_path / "a/step_6"
    assert read_metadata(saved).pieces == 2
    assert sorted(p.name for p in (saved / "model").iterdir()) == [
        f"tp{t:02d}-pp00-piece{d:02d}.safetensors" for t in range(2) for d in range(2)
    ]
    for checkpoint, out_dir in ((saved, tmp_path / "hf"), (llama_tp1.dir / "step_6", tmp_path / "hf_tp1")):
        out = run_command(["mtk", "export", str(checkpoint), str(out_dir)], timeout=600)
        assert out.returncode == 0 and "verified" in out.stdout, out.stderr[-2000:]
    zero3, tp1 = (load_file(str(d / "model.safetensors")) for d in (tmp_path / "hf", tmp_path / "hf_tp1"))
    assert sorted(zero3) == sorted(tp1)
    for name, tensor in tp1.items():  # after 6 AdamW steps in fp32 (Adam amplifies the rounding of tiny gradients)
        assert_close_rel(zero3[name], tensor, f"{name} exported from ZeRO-3's partitions", tol=1e-4)


def test_zero3_at_one_data_parallel_rank_exports(tmp_path):
    """ZeRO-3 with DP = 1 (TP = 2 on 2 processes): each rank's one piece is still a piece file, which the metadata
    says (``pieces: 1``), so `mtk export` reads it."""
    from mtk.checkpoint.meta import read_metadata

    args = ("--tp", "2", "--batch_size", "8", "--max_steps", "2", "--save_every", "2", "--output_dir", str(tmp_path))
    deepspeed_run(2, "zero3", *args)
    assert read_metadata(tmp_path / "step_2").pieces == 1
    assert_checkpoint_whole(tmp_path / "step_2")
    out = run_command(["mtk", "export", str(tmp_path / "step_2"), str(tmp_path / "hf")], timeout=600)
    assert out.returncode == 0 and "verified" in out.stdout, out.stderr[-2000:]


def test_zero3_through_accelerate_yaml(reference, tmp_path):
    """accelerate_configs/tp2_dp2_zero3.yaml: accelerate's DeepSpeed at stage 3 with mtk's TP = 2 (from the JSON)."""
    losses = step_losses(
        accelerate_launch(
            "finetune.py", "tp2_dp2_zero3", "--batch_size", "4", "--max_steps", "6", "--output_dir", str(tmp_path)
        )
    )
    for step in range(1, 7):
        assert_close_rel(losses[step], reference[step], f"accelerate + ZeRO-3 TP2xDP2 loss at step {step}")


def test_resume_and_export_a_deepspeed_checkpoint(zero2_run, tmp_path):
    out_dir, uninterrupted, _ = zero2_run
    resumed = step_losses(
        deepspeed_run(
            4,
            "zero2",
            "--tp",
            "2",
            "--batch_size",
            "4",
            "--max_steps",
            "6",
            "--output_dir",
            str(tmp_path / "resumed"),
            "--resume",
            str(out_dir / "step_3"),
        )
    )
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert_close_rel(resumed[step], uninterrupted[step], f"loss at step {step} after resume")
    out = run_command(["mtk", "export", str(out_dir / "step_6"), str(tmp_path / "hf")], timeout=600)
    assert out.returncode == 0 and "verified" in out.stdout, out.stderr[-2000:]
    assert (tmp_path / "hf" / "generation_config.json").is_file()  # run.py's checkpoints kept none: eos ids lost
    # ZeRO-2's flat partitions resume at their own layout only (ZeRO-3's at another TP or DP size: above)
    out = deepspeed_run(
        2, "zero2", "--tp", "1", "--batch_size", "8", "--max_steps", "6", "--output_dir", str(tmp_path / "moved"),
        "--resume", str(out_dir / "step_3"), check=False,
    )  # fmt: skip
    assert out.returncode != 0 and "a DeepSpeed checkpoint resumes at its own layout" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


def test_bad_deepspeed_input_is_one_line(tmp_path):
    out = deepspeed_run(
        2,
        "zero2",
        "--tp",
        "2",
        "--max_steps",
        "1",
        "--output_dir",
        str(tmp_path),
        "--resume",
        str(tmp_path / "nowhere"),
        check=False,
    )
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.startswith("run.py: error: ")]
    assert len(lines) == 1, out.stderr[-2000:]  # both ranks fail alike: the first to fail reports, with its rank
    missing = re.escape(f"checkpoint directory {tmp_path / 'nowhere'} does not exist")
    assert re.fullmatch(rf"run\.py: error: (\[rank 1\] )?{missing}", lines[0]), lines[0]


def test_deepspeed_gradient_accumulation_equals_the_larger_batch(reference, tmp_path):
    losses = step_losses(
        deepspeed_run(
            4,
            "zero2",
            "--tp",
            "2",
            "--batch_size",
            "2",
            "--grad_accum",
            "2",
            "--max_steps",
            "6",
            "--output_dir",
            str(tmp_path),
        )
    )
    for step in range(1, 7):
        assert_close_rel(losses[step], reference[step], f"ZeRO-2 2x2 accumulation loss at step {step}")


def write_json(path: Path, **fields) -> str:
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "steps_per_print": 1000000, **fields}))
    return str(path)


def test_a_json_accumulation_the_flag_overrides_is_one_line_and_the_same_run(reference, tmp_path):
    """--grad_accum beats the JSON's gradient_accumulation_steps, says so in one line, and the engine, the loader
    and the token weighting all use it: the losses are those of global batch 8."""
    config = write_json(tmp_path / "ds.json", train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=4)
    out = deepspeed_run(2, config, "--batch_size", "4", "--grad_accum", "1", "--max_steps", "6",
                        "--output_dir", str(tmp_path / "out"))  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if line.startswith("mtk: --grad_accum")]
    assert lines == [
        f"mtk: --grad_accum 1 overrides gradient_accumulation_steps 4 in {config}: global batch 8 = micro 4 x "
        "accumulation 1 x dp 2 (dp = world 2 / tp 1)"
    ], out.stdout[-2000:]
    losses = step_losses(out)
    for step in range(1, 7):
        assert_close_rel(losses[step], reference[step], f"JSON accumulation overridden: loss at step {step}")


def test_a_json_with_only_train_batch_size_runs_that_global_batch(reference, tmp_path):
    """DeepSpeed's derivation with DP from the mpu: train_batch_size 8 at --batch_size 2 and dp 2 accumulates 2."""
    config = write_json(tmp_path / "ds.json", train_batch_size=8)
    out = deepspeed_run(2, config, "--batch_size", "2", "--max_steps", "6", "--output_dir", str(tmp_path / "out"))
    assert "global batch 8 examples" in out.stdout, out.stdout[-2000:]
    losses = step_losses(out)
    for step in range(1, 7):
        assert_close_rel(losses[step], reference[step], f"train_batch_size only: loss at step {step}")


def _without_a_launcher() -> dict[str, str]:
    """This environment without the variables a launcher exports (as a plain ``python`` in a shell has it)."""
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}


def test_run_py_without_the_launcher_is_one_process(reference, tmp_path):
    """``python examples/run.py --deepspeed ...`` (no ``deepspeed`` launcher): one process, said in one line, with the
    one-process losses (DeepSpeed alone would look for MPI: ``ModuleNotFoundError: mpi4py``)."""
    command = [sys.executable, "examples/run.py", "--deepspeed", "--deepspeed_config", "ds_configs/zero2.json",
               "--max_steps", "2", "--output_dir", str(tmp_path)]  # fmt: skip
    out = run_command(command, cwd=ROOT, env=_without_a_launcher())
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mtk: started without the deepspeed launcher: one process" in out.stdout
    losses = step_losses(out)
    for step in (1, 2):
        assert_close_rel(losses[step], reference[step], f"run.py alone, loss at step {step}")


@pytest.mark.parametrize(
    ("variable", "hint"),
    [("ACCELERATE_USE_DEEPSPEED", "a launcher's variable set by hand"), ("WORLD_SIZE", "WORLD_SIZE is set")],
)
def test_a_launchers_variable_set_by_hand_is_one_line(tmp_path, variable, hint):
    """``ACCELERATE_USE_DEEPSPEED=true`` or ``WORLD_SIZE=2`` exported before a plain ``python finetune.py``:
    accelerate refuses the environment; one line saying what to do, exit status 2."""
    command = [sys.executable, "examples/finetune.py", "--max_steps", "1", "--output_dir", str(tmp_path)]
    value = "true" if variable.startswith("ACC") else "2"
    out = run_command(command, cwd=ROOT, env={**_without_a_launcher(), variable: value})
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert lines[-1].startswith("finetune.py: error: ") and hint in lines[-1] and "accelerate launch" in lines[-1]


def test_deepspeed_bf16_trains(tmp_path):
    losses = step_losses(
        deepspeed_run(
            4, "zero2_bf16", "--tp", "2", "--batch_size", "4", "--max_steps", "15", "--output_dir", str(tmp_path)
        )
    )
    assert losses[15] < losses[1] - 1.0, losses


def test_zero2_cpu_offload_equals_non_zero(reference, tmp_path):
    """ds_configs/zero2_offload.json: optimizer state and step on the CPU (DeepSpeedCPUAdam, built once)."""
    losses = step_losses(
        deepspeed_run(
            4, "zero2_offload", "--tp", "2", "--batch_size", "4", "--max_steps", "6", "--output_dir", str(tmp_path)
        )
    )
    for step in range(1, 7):
        assert_close_rel(losses[step], reference[step], f"ZeRO-2 offload TP2xDP2 loss at step {step}")


def test_deepspeed_through_accelerate_yaml(reference, tmp_path):
    """accelerate launch --config_file accelerate_configs/tp2_dp2_zero2.yaml examples/finetune.py: accelerate
    runs DeepSpeed, mtk gives it the topology as mpu; TP from the DeepSpeed JSON. Exact, and resumes exactly; the
    resume with ACCELERATE_USE_CPU=true exported (accelerate would drop DeepSpeed for it) says it set the variable
    aside, as DeepSpeed runs on this machine's CPU anyway."""
    first = step_losses(
        accelerate_launch(
            "finetune.py", "tp2_dp2_zero2", "--batch_size", "4", "--max_steps", "6", "--save_every", "3",
            "--output_dir", str(tmp_path / "a"),
        )
    )  # fmt: skip
    for step in range(1, 7):
        assert_close_rel(first[step], reference[step], f"accelerate + ZeRO-2 TP2xDP2 loss at step {step}")
    assert (tmp_path / "a" / "step_3" / "deepspeed").is_dir()
    out = accelerate_launch(
        "finetune.py", "tp2_dp2_zero2", "--batch_size", "4", "--max_steps", "6",
        "--output_dir", str(tmp_path / "b"), "--resume", str(tmp_path / "a" / "step_3"),
        env={**os.environ, "ACCELERATE_USE_CPU": "true"},
    )  # fmt: skip
    assert "mtk: ACCELERATE_USE_CPU=true set aside: this machine has no accelerator" in out.stdout + out.stderr
    resumed = step_losses(out)
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert_close_rel(resumed[step], first[step], f"accelerate + ZeRO-2 loss at step {step} after resume")


def test_accelerate_steps_and_weights_tokens_with_the_json_accumulation(reference, tmp_path):
    """Through accelerate, the JSON's gradient_accumulation_steps (no --grad_accum) is the one the engine steps with
    and the one finetune.py weights tokens by: micro 2 x accumulation 2 x dp 2 gives the losses of global batch 8
    (before, the loop took 1 while the engine took the JSON's, and logged the loss x accumulation)."""
    config = json.loads((ROOT / "ds_configs" / "accelerate_zero2_tp2.json").read_text())
    write_json(tmp_path / "ds.json", **{**config, "gradient_accumulation_steps": 2})
    yaml = (ROOT / "accelerate_configs" / "tp2_dp2_zero2.yaml").read_text()
    (tmp_path / "ds.yaml").write_text(yaml.replace("ds_configs/accelerate_zero2_tp2.json", str(tmp_path / "ds.json")))
    out = accelerate_launch("finetune.py", str(tmp_path / "ds.yaml"), "--batch_size", "2", "--max_steps", "6",
                            "--output_dir", str(tmp_path / "out"))  # fmt: skip
    assert "global batch 8 examples" in out.stdout + out.stderr
    losses = step_losses(out)
    for step in range(1, 7):
        assert_close_rel(losses[step], reference[step], f"accelerate + JSON accumulation 2: loss at step {step}")


def test_zero0_fp32_clips_by_and_logs_the_global_norm(llama_tp1, tmp_path):
    """ZeRO-0 in fp32 steps the script's own optimizer and DeepSpeed keeps no gradient norm there (through
    accelerate the run stopped at step 1, "the gradient norm is nan"). mtk clips in its place: the losses and the
    logged norms of the non-ZeRO run, at TP 2 through accelerate and under DeepSpeed's launcher."""
    config = json.loads((ROOT / "ds_configs" / "accelerate_zero2_tp2.json").read_text())
    write_json(tmp_path / "ds.json", **{**config, "zero_optimization": {"stage": 0}})
    yaml = (ROOT / "accelerate_configs" / "tp2_dp2_zero2.yaml").read_text()
    yaml = yaml.replace("ds_configs/accelerate_zero2_tp2.json", str(tmp_path / "ds.json"))
    (tmp_path / "ds.yaml").write_text(yaml.replace("num_processes: 4", "num_processes: 2"))
    six_steps = ("--max_steps", "6")
    runs = {
        "accelerate": accelerate_launch(
            "finetune.py", str(tmp_path / "ds.yaml"), *six_steps, "--output_dir", str(tmp_path / "accelerate")
        ),
        "run.py": deepspeed_run(2, "zero0", "--tp", "2", *six_steps, "--output_dir", str(tmp_path / "run.py")),
    }
    expected = logged(llama_tp1.dir)
    assert min(expected.values()) > 1.0  # every step clipped at 1.0
    for name, out in runs.items():
        assert_same_losses(step_losses(out), llama_tp1.losses, range(1, 7), f"ZeRO-0 TP 2 ({name})")
        norms = logged(tmp_path / name)
        for step in range(1, 7):
            assert_close_rel(norms[step], expected[step], f"ZeRO-0 TP 2 ({name}): gradient norm at step {step}")


def test_a_non_finite_deepspeed_step_stops_the_run_before_it_is_saved(tmp_path):
    """DeepSpeed steps before mtk sees the norm (no skipping in fp32): the run stops at that step, unsaved."""
    out = deepspeed_run(2, "zero2", "--lr", "1e30", "--warmup_steps", "0", "--max_steps", "4", "--save_every", "1",
                        "--batch_size", "4", "--output_dir", str(tmp_path), check=False)  # fmt: skip
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.startswith("run.py: error: ")]
    assert len(lines) == 1 and re.search(
        r"step 2: the (loss|gradient norm) is (nan|inf); stopped before non-finite weights are saved \(lower --lr\)",
        lines[0],
    ), out.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_1"]


def test_a_deepspeed_resume_that_changes_the_data_stream_is_one_line(zero2_run, tmp_path):
    """As with Accelerate's ResumeGuard: a changed --seq_len would continue on different data."""
    import shutil

    out_dir, *_ = zero2_run
    shutil.copytree(out_dir / "step_6", tmp_path / "step_6")
    out = deepspeed_run(4, "zero2", "--tp", "2", "--batch_size", "4", "--max_steps", "7", "--output_dir",
                        str(tmp_path), "--resume", "auto", "--seq_len", "64", check=False)  # fmt: skip
    lines = [line for line in out.stderr.splitlines() if line.startswith("run.py: error: ")]
    assert out.returncode != 0 and len(lines) == 1, out.stderr[-2000:]
    assert "this run changes --seq_len 128 -> 64 from the checkpoint it resumes" in lines[0]


def test_max_grad_norm_reaches_deepspeed_through_accelerate(reference, tmp_path):
    """finetune.py --max_grad_norm under accelerate's DeepSpeed config: DeepSpeed clips by it inside its step
    (accelerate filled the JSON's "auto" with 1.0, and the flag, given to a clip_grad_norm_ that only returns
    DeepSpeed's norm, was dropped unsaid). ZeRO-2 at DP 2 logs the losses of plain DP 2 at the same clipping, which
    are not those clipped at 1.0; a JSON stating another clipping is one line."""
    config = json.loads((ROOT / "ds_configs" / "accelerate_zero2_tp2.json").read_text())
    del config["mtk"]  # (TP 1)
    yaml = (
        (ROOT / "accelerate_configs" / "tp2_dp2_zero2.yaml")
        .read_text()
        .replace("num_processes: 4", "num_processes: 2")
    )
    for name, clipping in (("auto", "auto"), ("stated", 1.0)):
        write_json(tmp_path / f"{name}.json", **{**config, "gradient_clipping": clipping})
        (tmp_path / f"{name}.yaml").write_text(
            yaml.replace("ds_configs/accelerate_zero2_tp2.json", str(tmp_path / f"{name}.json"))
        )
    clipped = ("--max_steps", "3", "--max_grad_norm", "0.05")
    runs = {
        "zero": accelerate_launch(
            "finetune.py", str(tmp_path / "auto.yaml"), *clipped, "--output_dir", str(tmp_path / "z")
        ),
        "plain": accelerate_launch("finetune.py", "tp1_dp2", *clipped, "--output_dir", str(tmp_path / "p")),
    }
    zero, plain = (step_losses(out) for out in runs.values())
    assert_same_losses(zero, plain, range(1, 4), "ZeRO-2 DP 2 at --max_grad_norm 0.05")
    assert abs(plain[3] - reference[3]) > 1e-3 * abs(reference[3]), (plain, reference)  # the clipping acted
    stated = accelerate_launch("finetune.py", str(tmp_path / "stated.yaml"), *clipped, "--output_dir",
                               str(tmp_path / "s"), check=False)  # fmt: skip
    one_line_error(stated, '"gradient_clipping": 1.0 disagrees with this run\'s gradient clipping 0.05')
