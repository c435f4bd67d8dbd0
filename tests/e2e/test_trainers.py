"""``mtk.trainers.Trainer`` under ``accelerate launch`` logs transformers' own Trainer's numbers at every layout.

Each run is ``tests/e2e/trainer_script.py``: a tiny Llama (vocabulary 101, padded under TP), uneven examples with
padding and prompt tokens without loss, accumulation 2, clipping, warm-up, evaluation every 2 steps. The
reference is the same script with transformers' class on one process (TP/PP layouts) or on 2 plain ``torchrun``
processes (layouts with DP = 2). Every logged ``loss``, ``grad_norm``, ``learning_rate`` and ``eval_loss`` must
agree within the exactness bar; checkpoints resume exactly at the same layout and at another one, and
``save_model`` writes what ``from_pretrained`` loads.
"""

import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file

from mtk.checkpoint.integrity import read_verified
from mtk.spawn import free_port
from mtk.testing import assert_close_rel
from tests.e2e.launch import ROOT, accelerate_launch, one_line_error, run_command

SCRIPT = "tests/e2e/trainer_script.py"
LOGGED = ("loss", "grad_norm", "learning_rate", "eval_loss", "eval_accuracy")
# Saved weights after four AdamW steps in fp32: Adam divides each entry's step by that entry's own gradient size, so
# an entry whose gradient nearly cancels carries fp32's relative rounding of it into its step (one entry of 3232 at
# 2e-5 of the tensor on an AVX2 CPU, below 1e-5 on AVX-512 ones). The logged numbers hold the 1e-5 bar.
TRAINED = 1e-4


def _history(out_dir: Path) -> list[dict]:
    return json.loads((out_dir / "log_history.json").read_text())


def _hf_run(out_dir: Path, processes: int, *extra: str) -> list[dict]:
    """transformers' Trainer: one process, or ``processes`` plain torchrun workers (CPU, gloo)."""
    if processes == 1:
        command = ["python", SCRIPT]
    else:
        command = ["torchrun", "--nproc_per_node", str(processes), "--master_port", str(free_port()), SCRIPT]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    args = ["--trainer", "hf", "--output_dir", str(out_dir), "--save_model", *extra]
    done = run_command([*command, *args], cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return _history(out_dir)


def _mtk_run(config: str, out_dir: Path, *args: str, env: dict | None = None, processes: int = 0) -> list[dict]:
    """mtk's Trainer under ``accelerate launch`` (``processes``: the launcher's ``--num_processes`` over the YAML's,
    the layout's DP size growing with it)."""
    launcher_args = ("--num_processes", str(processes)) if processes else ()
    launch = accelerate_launch(
        SCRIPT, config, "--trainer", "mtk", "--output_dir", str(out_dir), *args, env=env, launcher_args=launcher_args
    )
    assert "Traceback" not in launch.stderr, launch.stderr[-3000:]
    return _history(out_dir)


def _rows_per_eval_step(history: list[dict]) -> list[float]:
    """Each evaluation's rows per step, from the speed metrics transformers logs (rows/s over steps/s)."""
    rates = [entry for entry in history if "eval_steps_per_second" in entry]
    assert rates, history
    return [entry["eval_samples_per_second"] / entry["eval_steps_per_second"] for entry in rates]


def assert_same_history(actual: list[dict], expected: list[dict], what: str, steps=None) -> None:
    """Every logged number of ``expected`` (at ``steps``, default all) within the bar in ``actual``."""
    want = [entry for entry in expected if steps is None or entry["step"] in steps]
    got = [entry for entry in actual if steps is None or entry["step"] in steps]
    assert [(e["step"], sorted(set(e) & set(LOGGED))) for e in got] == [
        (e["step"], sorted(set(e) & set(LOGGED))) for e in want
    ], (got, want)
    for mine, theirs in zip(got, want):
        for key in set(theirs) & set(LOGGED):
            assert_close_rel(mine[key], theirs[key], f"{what}: {key} at step {theirs['step']}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """transformers' Trainer on one process and on two (DP = 2): histories and final-model directories."""
    root = tmp_path_factory.mktemp("trainer_reference")
    return {
        1: (_hf_run(root / "dp1", 1), root / "dp1"),
        2: (_hf_run(root / "dp2", 2), root / "dp2"),
        "metrics": (_hf_run(root / "metrics", 1, "--metrics"), root / "metrics"),
    }


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trainer_tp2")
    _mtk_run("tp2", out, "--save_steps", "2", "--save_model", "--metrics")
    return out


def test_tp2_logs_the_trainers_numbers_and_saves_what_from_pretrained_loads(reference, tp2_run):
    """compute_metrics gets the full logits (token accuracy equal to transformers'), never a vocabulary shard."""
    history, hf_dir = reference["metrics"]
    assert any("eval_accuracy" in entry for entry in history)
    assert_same_history(_history(tp2_run), history, "TP=2")
    # the evaluation's step rate counts replicas' steps (the world counted both TP ranks: half the steps)
    assert _rows_per_eval_step(_history(tp2_run)) == pytest.approx(_rows_per_eval_step(history), rel=0.01)
    ours = load_file(tp2_run / "final" / "model.safetensors")
    theirs = load_file(hf_dir / "final" / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert_close_rel(ours[name], theirs[name], f"saved {name}", tol=TRAINED)


def test_tp2_cp2_logs_the_trainers_numbers_with_metrics_on_whole_rows(reference, tmp_path):
    """accelerate_configs/tp2_cp2.yaml: each row split over two ranks; the loss, gradient norm and evaluation
    loss are the single-process Trainer's, compute_metrics gets the whole rows' logits, save_model writes its
    model."""
    history, hf_dir = reference["metrics"]
    ours = _mtk_run("tp2_cp2", tmp_path, "--metrics", "--save_model")
    assert_same_history(ours, history, "TP=2 x CP=2")
    saved, theirs = (load_file(d / "final" / "model.safetensors") for d in (tmp_path, hf_dir))
    assert sorted(saved) == sorted(theirs)
    for name in theirs:
        assert_close_rel(saved[name], theirs[name], f"saved {name}", tol=TRAINED)


def test_label_smoothing_at_tp2_cp2_logs_the_trainers_numbers(tmp_path):
    """label_smoothing_factor: the Trainer takes the labels out and smooths over the logits the model returns, which
    are the whole vocabulary's and the whole rows' under mtk (it was refused, as if only a shard were there)."""
    smoothing = ("--label_smoothing", "0.1")  # (evaluation smooths too: eval_loss at steps 2 and 4)
    history = _hf_run(tmp_path / "hf", 1, *smoothing)
    assert_same_history(_mtk_run("tp2_cp2", tmp_path / "mtk", *smoothing), history, "label smoothing at TP=2 x CP=2")


def test_checkpoint_n_is_a_verified_mtk_checkpoint_with_the_trainer_state_inside(tp2_run):
    checkpoint = tp2_run / "checkpoint-2"
    meta = read_verified(checkpoint)
    assert meta.step == 2 and meta.topology.tp_size == 2
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 2
    assert "trainer_state.json" in meta.files  # listed and checksummed with the shards
    exported = tp2_run.parent / "exported_checkpoint_2"
    done = run_command(["mtk", "export", str(checkpoint), str(exported)], cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (exported / "config.json").is_file()


@pytest.mark.parametrize(
    "config, resume_at", [("tp2", "tp2"), ("tp2", "single process")], ids=["same layout", "tp2 to tp1"]
)
def test_resume_from_checkpoint_n_continues_exactly(reference, tp2_run, tmp_path, config, resume_at):
    history, _ = reference[1]
    out = tmp_path / "resumed"
    out.mkdir()
    checkpoint = str(tp2_run / "checkpoint-2")
    if resume_at == "single process":
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        command = ["python", SCRIPT, "--trainer", "mtk", "--output_dir", str(out), "--resume", checkpoint]
        done = run_command(command, cwd=ROOT, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        resumed = _history(out)
    else:
        resumed = _mtk_run(config, out, "--resume", checkpoint)
    assert_same_history(resumed, history, f"resumed at {resume_at}", steps={3, 4})


@pytest.mark.parametrize(
    "config, env, args, dp",
    [
        ("tp2_dp2", {}, (), 2),
        ("tp2_pp2", {}, (), 1),
        ("tp1_pp2", {"MTK_PIPELINE_SCHEDULE": "interleaved", "MTK_VIRTUAL_STAGES": "2"}, (), 1),
        ("tp2_dp2_zero2", {}, ("--deepspeed", "ds_configs/accelerate_zero3_tp2.json"), 2),
        ("tp2_dp2_zero2", {}, (), 2),  # the JSON the YAML names: its "auto"s filled before mtk reads them
        ("tp1_pp2", {}, (), 2),  # 4 processes: PP 2 x DP 2 (the pipeline's loss factor over DP replicas)
    ],
    ids=[
        "tp2_dp2", "tp2_pp2", "pp2_interleaved", "deepspeed_zero3_tp2_dp2",
        "deepspeed_zero2_from_the_yaml", "pp2_dp2",
    ],
)  # fmt: skip
def test_layouts_log_the_trainers_numbers(reference, tmp_path, config, env, args, dp):
    """TrainingArguments(deepspeed=...) included: ZeRO-2 and ZeRO-3 over DP (the JSON given to the arguments wins
    over the launcher's), TP from the JSON's "mtk" block, its "auto" global batch derived from the DP size
    (transformers fills it from the world size). Under ZeRO-3 save_model gathers one parameter at a time and
    writes the single-process Trainer's model."""
    history, hf_dir = reference[dp]
    zero3 = "zero3" in "".join(args)
    processes = 4 if config == "tp1_pp2" and dp == 2 else 0
    saving = ["--save_model"] if zero3 else []
    ours = _mtk_run(config, tmp_path / "run", *args, *saving, env={**os.environ, **env}, processes=processes)
    assert_same_history(ours, history, config + (" interleaved" if env else "") + (f" dp {dp}" if processes else ""))
    if zero3:
        saved, theirs = (load_file(d / "final" / "model.safetensors") for d in (tmp_path / "run", hf_dir))
        assert sorted(saved) == sorted(theirs)
        for name in theirs:
            assert_close_rel(saved[name], theirs[name], f"saved {name}", tol=TRAINED)


def test_a_deepspeed_checkpoint_n_resumes_exactly_and_one_of_another_engine_is_one_line(reference, tp2_run, tmp_path):
    """ZeRO-2 over DP at TP 2 (TrainingArguments.deepspeed): transformers' DP=2 numbers; its checkpoint-2 (DeepSpeed's
    state inside mtk's checkpoint) resumed under the same engine continues them (transformers looked for DeepSpeed's
    folders beside it and raised); a checkpoint-2 written without DeepSpeed, resumed under it (the same 8 rows a
    step), is one line."""
    history, _ = reference[2]
    zero2 = ("--deepspeed", "ds_configs/accelerate_zero2_tp2.json")
    assert_same_history(_mtk_run("tp2_dp2_zero2", tmp_path / "a", *zero2, "--save_steps", "2"), history, "ZeRO-2")
    resumed = _mtk_run("tp2_dp2_zero2", tmp_path / "b", *zero2, "--resume", str(tmp_path / "a" / "checkpoint-2"))
    assert_same_history(resumed, history, "ZeRO-2 resumed under ZeRO-2", steps={3, 4})
    plain = str(tp2_run / "checkpoint-2")
    args = ("--trainer", "mtk", "--output_dir", str(tmp_path / "c"), *zero2, "--resume", plain, "--grad_accum", "1")
    other = accelerate_launch(SCRIPT, "tp2_dp2_zero2", *args, check=False)
    one_line_error(other, f"{plain} was not written by the DeepSpeed engine", prog="trainer_script.py")


def test_a_hyperparameter_search_under_deepspeed_sets_each_trial_up_anew(reference, tmp_path):
    """transformers' hyperparameter_search with DeepSpeed (ZeRO-2 over DP at TP 2): each trial builds its model
    (model_init) and its engine again; every trial, the same run here, logs transformers' DP=2 numbers. mtk's
    refusal of a second train() under DeepSpeed refused the second trial before."""
    history, _ = reference[2]
    args = ("--deepspeed", "ds_configs/accelerate_zero2_tp2.json", "--search", "2", "--eval_steps", "0")
    launch = accelerate_launch(SCRIPT, "tp2_dp2_zero2", "--trainer", "mtk", "--output_dir", str(tmp_path), *args)
    assert "Traceback" not in launch.stderr, launch.stderr[-3000:]
    trials = json.loads((tmp_path / "trials.json").read_text())
    assert len(trials) == 2
    for number, trial in enumerate(trials):
        logged = [entry for entry in history if "eval_loss" not in entry]
        assert_same_history(trial, logged, f"trial {number}", steps={1, 2, 3, 4})


def test_zero3_at_tp1_dp2_logs_the_trainers_numbers_and_saves_the_model(reference, tmp_path):
    """transformers' ZeRO-3 JSON of "auto"s with no "mtk" block at TP1 x DP2, every parameter partitioned over
    both ranks (no persistence threshold: DeepSpeed keeps parameters under 100k elements whole by default);
    save_model makes each whole in its turn (the gather reads the parameter inside ZeRO-3's gather). No
    evaluation: a last evaluation leaves ZeRO-3's parameters gathered, which hid a gather of the placeholder."""
    history, hf_dir = reference[2]
    autos = {key: "auto" for key in ("train_micro_batch_size_per_gpu", "train_batch_size")}
    autos.update({"gradient_accumulation_steps": "auto", "gradient_clipping": "auto"})
    config = tmp_path / "zero3.json"
    config.write_text(
        json.dumps(
            {
                **autos,
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                "zero_allow_untested_optimizer": True,
            }
        )
    )
    ours = _mtk_run("tp1_dp2", tmp_path / "run", "--deepspeed", str(config), "--save_model", "--eval_steps", "0")

    def trained(entries: list[dict]) -> list[dict]:  # (the reference's evaluations left out)
        return [entry for entry in entries if "loss" in entry]

    assert_same_history(trained(ours), trained(history), "tp1_dp2 zero3")
    saved, theirs = (load_file(d / "final" / "model.safetensors") for d in (tmp_path / "run", hf_dir))
    assert sorted(saved) == sorted(theirs)
    for name in theirs:
        assert_close_rel(saved[name], theirs[name], f"saved {name}", tol=TRAINED)


def test_fsdp2_logs_the_trainers_numbers_resumes_at_plain_tp2_dp2_and_saves_the_model(reference, tmp_path):
    """accelerate_configs/tp2_fsdp2.yaml (parallelism_config tp_size 2 x dp_shard_size 2): transformers' DP=2
    numbers; its checkpoint-2 (saved in FSDP2's pieces) resumed at plain TP2 x DP2; save_model writes the
    whole model, gathered over DP and TP."""
    history, hf_dir = reference[2]
    sharded = _mtk_run("tp2_fsdp2", tmp_path / "fsdp2", "--save_steps", "2", "--save_model")
    assert_same_history(sharded, history, "tp2_fsdp2")
    resumed = _mtk_run("tp2_dp2", tmp_path / "resumed", "--resume", str(tmp_path / "fsdp2" / "checkpoint-2"))
    assert_same_history(resumed, history, "tp2_dp2 resumed from FSDP2's checkpoint-2", steps={3, 4})
    ours = load_file(tmp_path / "fsdp2" / "final" / "model.safetensors")
    theirs = load_file(hf_dir / "final" / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert_close_rel(ours[name], theirs[name], f"saved {name}", tol=TRAINED)


def test_expert_parallelism_logs_the_trainers_dp2_numbers_on_an_moe_model(tmp_path):
    """accelerate_configs/ep2.yaml with a tiny Qwen3-MoE: transformers' Trainer on 2 plain torchrun processes (EP is
    carved out of DP, so DP 2 is its reference); save_model gathers the experts over EP."""
    history = _hf_run(tmp_path / "hf", 2, "--moe")
    ours = _mtk_run("ep2", tmp_path / "ep2", "--moe", "--save_model")
    assert_same_history(ours, history, "ep2")
    saved, theirs = (load_file(d / "final" / "model.safetensors") for d in (tmp_path / "ep2", tmp_path / "hf"))
    assert sorted(saved) == sorted(theirs) and any("experts" in name for name in theirs)
    for name in theirs:
        assert_close_rel(saved[name], theirs[name], f"saved {name}", tol=TRAINED)


def test_a_refused_training_argument_is_one_line(tmp_path):
    """Accepted-and-ignored is not an option: what mtk cannot honour stops the run, naming the field, in one line
    (no traceback) even though the script's main is the user's."""
    script = tmp_path / "refused.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from mtk.trainers import Trainer\n"
        "from transformers import TrainingArguments\n"
        "from tests.e2e.trainer_script import model\n"
        f"args = TrainingArguments(output_dir={str(tmp_path / 'out')!r}, torch_compile=True, report_to=[])\n"
        "Trainer(model=model(), args=args)\n"
    )
    done = run_command(["python", str(script)], timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("refused.py: error:")]
    expected = "TrainingArguments.torch_compile=True: mtk's parallel layers are not compiled yet; leave it off"
    assert errors == [f"refused.py: error: {expected}"], done.stderr[-2000:]


def test_compute_metrics_at_pp_is_one_line_before_training(tmp_path):
    """A pipelined model returns its loss only: compute_metrics (which needs the logits) was refused at the first
    evaluation, after the steps before it had trained, and named compute_metrics for predict() too. With
    prediction_loss_only transformers never asks for the logits nor calls compute_metrics: that run trains."""
    args = ("--trainer", "mtk", "--output_dir", str(tmp_path / "run"), "--metrics")
    out = accelerate_launch(SCRIPT, "tp1_pp2", *args, check=False)
    one_line_error(out, "with pp > 1 the pipelined model returns its loss only, not logits", prog="trainer_script.py")
    assert "'loss'" not in out.stdout + out.stderr and not list((tmp_path / "run").glob("checkpoint-*"))
    loss_only = ("--trainer", "mtk", "--output_dir", str(tmp_path / "loss_only"), "--metrics", "--loss_only")
    accelerate_launch(SCRIPT, "tp1_pp2", *loss_only, "--max_steps", "2")
    history = json.loads((tmp_path / "loss_only" / "log_history.json").read_text())
    assert [entry["step"] for entry in history if "eval_loss" in entry] == [2], history
