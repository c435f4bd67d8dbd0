"""What a Trainer run (examples/sft.py, mtk's ``SFTTrainer``) keeps of a user's files and how it stops.

transformers' Trainer writes ``checkpoint-N`` into whatever ``output_dir`` it is given and rotates away every
``checkpoint-*`` folder there; it installs no signal handler. Under mtk a fresh run into a folder holding an earlier
run's checkpoints is one line, rotation removes only the checkpoints the run's lineage wrote, a script's ``step_N``
given to ``resume_from_checkpoint`` is one line, and SIGTERM saves ``checkpoint-N`` at the next step's end (as
mtk's scripts do) and ends the run with a line saying how to continue.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mtk.checkpoint.integrity import file_checksum, read_verified
from mtk.spawn import free_port
from mtk.testing import assert_close_rel
from tests.e2e.launch import ROOT, accelerate_launch, one_line_error, run_command

SFT = [sys.executable, "examples/sft.py"]
HUB = "tests/e2e/hub_script.py"
ROOT_PATH = Path(ROOT)


def _sft(out_dir, *args: str) -> subprocess.CompletedProcess:
    return run_command([*SFT, "--output_dir", str(out_dir), *args], cwd=ROOT)


def _one_line(out: subprocess.CompletedProcess, said: str) -> None:
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("sft.py: error: ") and said in out.stderr, out.stderr


def test_a_trainer_run_keeps_what_was_in_its_output_dir(llama_tp1, tmp_path):
    """A user's ``checkpoint-0/`` blocks a fresh run (it was rotated away); the run's own rotation keeps only its
    lineage's checkpoints, a resumed run's included; a second fresh run into the folder is refused; a finetune.py
    ``step_N`` is not resumed as a Trainer checkpoint."""
    mine = tmp_path / "out" / "checkpoint-0"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    _one_line(_sft(tmp_path / "out", "--max_steps", "2"), "holds checkpoint-0, which no mtk Trainer wrote")
    assert (mine / "notes.txt").read_text() == "mine"
    model_dir = tmp_path / "base"  # a model given as the output_dir too: save_model would replace its files
    model_dir.mkdir()
    for name in ("config.json", "model.safetensors"):
        (model_dir / name).write_text("mine")
    _one_line(
        _sft(model_dir, "--max_steps", "2"),
        "already holds a model or tokenizer (config.json, model.safetensors), which",
    )
    assert [(model_dir / name).read_text() for name in ("config.json", "model.safetensors")] == ["mine", "mine"]
    tokenizer_dir = tmp_path / "tokenizer"  # a tokenizer alone: save_model writes its files too
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer.json").write_text("mine")
    _one_line(_sft(tokenizer_dir, "--max_steps", "2"), "already holds a model or tokenizer (tokenizer.json)")
    assert (tokenizer_dir / "tokenizer.json").read_text() == "mine"

    run = tmp_path / "run"
    rotating = ("--save_steps", "1", "--save_total_limit", "1")
    assert _sft(run, "--max_steps", "2", *rotating).returncode == 0
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2"]
    (run / "checkpoint-0").mkdir()
    (run / "checkpoint-0" / "notes.txt").write_text("mine")
    resumed = _sft(run, "--max_steps", "3", *rotating, "--resume_from_checkpoint", str(run / "checkpoint-2"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-0", "checkpoint-3"]
    assert (run / "checkpoint-0" / "notes.txt").read_text() == "mine"

    _one_line(_sft(run, "--max_steps", "2"), "already holds checkpoint-3 of an earlier run")  # (not the user's)
    continued = _sft(run, "--max_steps", "4", *rotating, "--resume_from_checkpoint", "True")  # as the lines advise
    assert continued.returncode == 0, continued.stderr[-2000:]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-0", "checkpoint-4"]
    finished = load_file(run / "model.safetensors")
    requeued = _sft(run, "--max_steps", "4", *rotating, "--resume_from_checkpoint", "True")  # the job that finished
    assert requeued.returncode == 0 and "max_steps 4: nothing is left to train" in requeued.stdout, requeued.stderr
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-0", "checkpoint-4"]  # (no 5th step)
    final = load_file(run / "model.safetensors")
    assert final.keys() == finished.keys() and all(torch.equal(final[k], finished[k]) for k in final)
    script_checkpoint = str(llama_tp1.dir / "step_3")
    refused = _sft(tmp_path / "other", "--resume_from_checkpoint", script_checkpoint)
    _one_line(refused, "is an mtk checkpoint of a training script (finetune.py, run.py: no trainer_state.json)")
    mistaken = _sft(tmp_path / "other", "--resume_from_checkpoint", str(run))  # the output_dir, not its checkpoint
    _one_line(mistaken, f"not a checkpoint-N the Trainer wrote (its newest checkpoint is {run / 'checkpoint-4'})")
    absent = _sft(tmp_path / "other", "--resume_from_checkpoint", str(run / "checkpoint-99"))
    _one_line(absent, f"resume_from_checkpoint={run / 'checkpoint-99'} does not exist; give a checkpoint-N folder")
    shutil.copytree(run / "checkpoint-4", model_dir / "run1" / "checkpoint-4")  # another output_dir inside it
    nested = _sft(model_dir, "--max_steps", "5", "--resume_from_checkpoint", str(model_dir / "run1" / "checkpoint-4"))
    _one_line(nested, "already holds a model or tokenizer (config.json, model.safetensors), which")


def test_a_resume_on_other_training_rows_is_one_line_unless_the_data_skip_is_ignored(tmp_path):
    """The Trainer resumes by skipping the checkpoint's number of batches of whatever data the run has: rows
    truncated at another ``max_length`` (the same file) or another order's seed would skip other rows, unsaid.
    Each is one line naming what changed; ``ignore_data_skip`` (the data from its start) resumes on them."""
    run = tmp_path / "run"
    assert _sft(run, "--max_steps", "2", "--save_steps", "2").returncode == 0
    resume = ("--max_steps", "3", "--resume_from_checkpoint", "True")
    _one_line(_sft(run, *resume, "--max_length", "12"), "are not those of the checkpoint it resumes")
    reordered = _sft(run, *resume, "--data_seed", "7")
    _one_line(reordered, "this run changes the data order's seed (data_seed, else seed) 42 -> 7 of the checkpoint")
    halved = _sft(run, *resume, "--per_device_train_batch_size", "4")  # steps x accumulation batches of 4 skipped
    _one_line(halved, "x data-parallel replicas, unless split_batches) 8 -> 4 of the checkpoint")
    regrouped = ("--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2")  # the same 8 rows a step
    again = _sft(
        tmp_path / "regrouped", "--max_steps", "3", "--resume_from_checkpoint", str(run / "checkpoint-2"), *regrouped
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2"]
    crafted = tmp_path / "crafted" / "checkpoint-2"  # the Trainer's scheduler (not prepared: a registered object)
    shutil.copytree(run / "checkpoint-2", crafted)
    scheduler = crafted / "custom_checkpoint_0.pt"
    torch.save({**torch.load(scheduler, weights_only=True), "last_epoch": -7, "_step_count": -6}, scheduler)
    meta = json.loads((crafted / "metadata.json").read_text())
    meta["files"][scheduler.name] = {"bytes": scheduler.stat().st_size, "xxh3_128": file_checksum(scheduler)}
    (crafted / "metadata.json").write_text(json.dumps(meta))
    _one_line(_sft(tmp_path / "other", "--resume_from_checkpoint", str(crafted)), "'last_epoch' is -7")

    (tmp_path / "unseeded.json").write_text('{"use_seedable_sampler": false}')
    for order, said in (
        (("--train_sampling_strategy", "group_by_length"), "group_by_length (transformers' LengthGroupedSampler)"),
        (
            ("--accelerator_config", str(tmp_path / "unseeded.json")),
            "use_seedable_sampler false (torch's RandomSampler)",
        ),
    ):  # orders drawn from the global random state when an epoch starts: not reproduced by a resume
        unseeded = tmp_path / order[0].removeprefix("--")
        assert _sft(unseeded, "--max_steps", "2", "--save_steps", "2", *order).returncode == 0
        _one_line(_sft(unseeded, *resume, *order), f"{said} draws the data order from the global random state")
    # nor by a seeded one: the checkpoint's own order is the one that cannot be continued
    _one_line(_sft(unseeded, *resume), "use_seedable_sampler false (torch's RandomSampler) draws the data order")

    other = _sft(run, *resume, "--max_length", "12", "--ignore_data_skip", "True", "--learning_rate", "5e-4")
    assert other.returncode == 0 and (run / "checkpoint-3").is_dir(), other.stderr[-2000:]
    assert "mtk: the checkpoint's learning rate [0.001, 0.001] is restored over this run's [0.0005" in other.stdout
    assert read_verified(run / "checkpoint-3").data["stream"]["order_seed"] == 42


@pytest.mark.parametrize(
    "block, flag, said",
    [
        (
            '"optimizer": {"type": "Adam", "params": {"lr": "auto"}}',
            ("--optim", "sgd"),
            '"optimizer" block (Adam) replaces TrainingArguments.optim=sgd, which would not run',
        ),
        (
            '"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}',
            ("--lr_scheduler_type", "cosine"),
            '"scheduler" block (WarmupLR) replaces TrainingArguments.lr_scheduler_type=cosine, which would not run',
        ),
        ('"zero_optimization": {"stage": 3}', (), "ds.json: key 'zero_optimization' is given twice; give each key"),
    ],
    ids=["optimizer", "scheduler", "a key given twice"],
)
def test_a_deepspeed_json_the_trainer_would_misread_is_one_line(tmp_path, block, flag, said):
    """transformers builds DeepSpeed's optimizer or scheduler from the JSON's block in place of the Trainer's own:
    ``--optim sgd`` trained Adam, ``--lr_scheduler_type cosine`` WarmupLR's constant rate, without a word; and it
    reads a key given twice as its last value (the line named no file)."""
    config = tmp_path / "ds.json"
    config.write_text(f'{{"zero_optimization": {{"stage": 2}}, "train_micro_batch_size_per_gpu": "auto", {block}}}')
    launch = ["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), "examples/sft.py"]
    done = run_command([*launch, "--output_dir", str(tmp_path / "o"), "--deepspeed", str(config), *flag], cwd=ROOT)
    errors = [line for line in done.stderr.splitlines() if line.startswith("sft.py: error: ")]
    assert done.returncode != 0 and len(errors) == 1 and said in errors[0], done.stderr[-2000:]


def test_how_a_data_parallel_trainer_run_takes_its_rows_is_kept_on_resume_or_refused(tmp_path):
    """Over two data-parallel replicas: ``split_batches`` makes per_device_train_batch_size the global batch (the
    resume guard recorded twice it, and took a resume without it that trains other rows); ``batch_rebalance``'s
    sampler splits rows over every process, where mtk's TP ranks share a replica's (at TP 2 it trained half)."""
    (tmp_path / "split.json").write_text('{"split_batches": true}')
    split = ("--max_steps", "2", "--save_steps", "2", "--accelerator_config", str(tmp_path / "split.json"))
    assert accelerate_launch("sft.py", "tp1_dp2", "--output_dir", str(tmp_path / "split"), *split).returncode == 0
    whole = accelerate_launch(
        "sft.py", "tp1_dp2", "--output_dir", str(tmp_path / "whole"), "--max_steps", "3",
        "--resume_from_checkpoint", str(tmp_path / "split" / "checkpoint-2"), check=False,
    )  # fmt: skip
    one_line_error(whole, "unless split_batches) 8 -> 16 of the checkpoint", prog="sft.py")
    launch = ["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), "examples/sft.py"]
    rebalanced = run_command(
        [*launch, "--output_dir", str(tmp_path / "r"), "--train_sampling_strategy", "batch_rebalance"], cwd=ROOT
    )
    one_line_error(
        rebalanced,
        "train_sampling_strategy=batch_rebalance is not supported by mtk's Trainer in a launched run",
        prog="sft.py",
    )


def test_sigterm_saves_a_trainer_run_at_the_next_step_and_ends_it(tmp_path):
    """SIGTERM (a scheduler's preemption) to a running sft.py: ``checkpoint-N`` of the step it reached, complete,
    one line saying so, status 0 (before, the process died at once: status 143, no line, the steps since the last
    checkpoint lost). A real process: the signal reaches it as a scheduler sends it."""
    out = tmp_path / "out"
    steps = ("--max_steps", "10000", "--save_steps", "100000", "--logging_steps", "1")
    command = [*SFT, "--output_dir", str(out), *steps]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    seen = ""
    for line in process.stdout:  # training has begun once the Trainer logs a step's loss
        seen += line
        if "'loss'" in line:
            break
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    seen += process.communicate(timeout=300)[0]
    assert process.returncode == 0 and "Traceback" not in seen, seen[-3000:]
    said = [line for line in seen.splitlines() if line.startswith("mtk: SIGTERM: saved ")]
    assert len(said) == 1 and said[0].endswith("; continue with resume_from_checkpoint=True"), seen[-3000:]
    saved = said[0].removeprefix("mtk: SIGTERM: saved ").split(";")[0]
    assert [str(p) for p in out.glob("checkpoint-*")] == [saved]
    read_verified(saved)  # complete: every file its metadata lists, checksums matching


def test_dpo_on_chat_rows_without_preference_columns_is_one_line(tmp_path):
    """dpo.py given SFT's chat rows: DPOTrainer's one line naming the missing column (the script's starter tokenizer
    raised a KeyError first)."""
    import json

    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": chat}) + "\n" for _ in range(20)))
    out = run_command([sys.executable, "examples/dpo.py", "--max_steps", "1", "--data", str(data),
                       "--output_dir", str(tmp_path / "out")], cwd=ROOT)  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("dpo.py: error: DPOTrainer's train_dataset has no 'chosen'")


def test_push_to_hub_pushes_what_transformers_pushes_without_the_runs_files(tmp_path):
    """``push_to_hub`` at TP 2 (the Hub replaced by a recorder: tests/e2e/hub_script.py): each checkpoint's push
    uploads the output directory holding that step's merged model, then the checkpoint folder as
    ``last-checkpoint`` (``hub_strategy=checkpoint``); ``save_model`` pushes the final model. The run's lock and
    staging folders are left out; a background checkpoint upload that failed is said at the next push. Before, the
    Trainer under mtk pushed nothing, without a word. A Hub that cannot be reached is one line."""
    log = tmp_path / "hub.jsonl"
    out = tmp_path / "out"
    flags = ("--max_steps", "2", "--save_steps", "1", "--push_to_hub", "True", "--hub_model_id", "me/tiny")
    env = {**os.environ, "MTK_HUB_LOG": str(log), "MTK_HUB_FAIL": "checkpoints"}
    launch = accelerate_launch(HUB, "tp2", *flags, "--hub_strategy", "checkpoint", "--output_dir", str(out), env=env)
    assert "Traceback" not in launch.stderr, launch.stderr[-3000:]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert {call["rank"] for call in calls} == {0}
    assert [call["call"] for call in calls] == ["create_repo", *["upload_folder"] * 5]
    pushed = [(Path(call["folder"]).name, call["path_in_repo"], call["message"]) for call in calls[1:]]
    assert pushed == [
        ("out", None, "Training in progress, step 1"),
        ("checkpoint-1", "last-checkpoint", "Training in progress, step 1, checkpoint"),
        ("out", None, "Training in progress, step 2"),
        ("checkpoint-2", "last-checkpoint", "Training in progress, step 2, checkpoint"),
        ("out", None, "Model save"),
    ]
    for call in calls[1:]:
        assert not any(".mtk" in name or "incomplete" in name for name in call["files"]), call["files"]
        if call["path_in_repo"] is None:
            assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(call["files"]), call["files"]
    step_1, step_2, final = (calls[i]["weights"] for i in (1, 3, 5))
    assert step_1 != step_2 == final == hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    failed = [line for line in launch.stdout.splitlines() if line.startswith("mtk: a push to the Hub failed")]
    assert len(failed) == 2, launch.stdout[-3000:]

    env = {**os.environ, "MTK_HUB_LOG": str(log), "MTK_HUB_FAIL": "create"}
    offline = run_command([sys.executable, HUB, *flags, "--output_dir", str(tmp_path / "offline")], cwd=ROOT, env=env)
    _one_line(offline, "push_to_hub: creating the Hub repository me/tiny failed (ConnectError: [Errno -2] Name or")


@pytest.mark.parametrize(
    "greater, strategy, best_step",
    [("True", "steps", 1), ("False", "steps", 3), ("False", "best", 3)],
    ids=["the first step best", "the last step best", "save_strategy best"],
)
def test_load_best_model_at_end_loads_the_best_checkpoint(tmp_path, greater, strategy, best_step):
    """``load_best_model_at_end``: transformers looked for ``model.safetensors`` in the best ``checkpoint-N``, which
    mtk's checkpoint does not hold, said it could not find it (advising ``save_on_each_node``, which mtk refuses)
    and kept the last weights, which ``save_model`` wrote. The best checkpoint is now read back through mtk's
    reader, and the saved model is its weights; the step being saved can be the best (it was taken for the one
    before: the state was written before the folder existed). The evaluation loss falls, so with
    ``greater_is_better`` the first step is the best."""
    from safetensors.torch import load_file

    data = "examples/data/instructions.jsonl"
    out = tmp_path / "out"
    best = ("--load_best_model_at_end", "True", "--metric_for_best_model", "loss", "--greater_is_better", greater)
    steps = ("--max_steps", "3", "--eval_strategy", "steps", "--eval_steps", "1", "--save_steps", "1")
    evaluation = ("--eval_data", data, "--per_device_eval_batch_size", "4")
    done = _sft(out, *steps, "--save_strategy", strategy, *best, *evaluation)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    newest = max(out.glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    state = json.loads((newest / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"] == str(out / f"checkpoint-{best_step}"), state
    assert f"mtk: loading the best model from {out / f'checkpoint-{best_step}'}" in done.stdout, done.stdout[-2000:]
    final = load_file(out / "model.safetensors")
    for checkpoint in sorted(out.glob("checkpoint-*")):
        equal = checkpoint.name == f"checkpoint-{best_step}"
        saved = load_file(checkpoint / "model" / "tp00-pp00.safetensors")
        common = sorted(set(final) & set(saved))
        assert len(common) == len(final), (sorted(final), sorted(saved))
        assert all(final[name].equal(saved[name]) for name in common) == equal, checkpoint


def test_sigterm_during_a_trainer_evaluation_stops_it_and_saves_that_step(tmp_path):
    """SIGTERM while the Trainer evaluates (a long evaluation set): the evaluation ends after the batch it arrived
    in, unlogged, and the step is saved at once, status 0. transformers ran the whole evaluation, logged it and
    trained one more step first (71 s after the signal for a 77-s evaluation: past a scheduler's grace time)."""
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i} of a long evaluation"}) + "\n" for i in range(20000)))
    out = tmp_path / "out"
    steps = ("--max_steps", "50", "--logging_steps", "1", "--eval_strategy", "steps", "--eval_steps", "2")
    evaluation = ("--eval_data", str(data), "--per_device_eval_batch_size", "1")
    command = [*SFT, "--output_dir", str(out), *steps, *evaluation]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    seen = ""
    for line in process.stdout:  # step 2's log comes just before its evaluation starts
        seen += line
        if "'loss'" in line and seen.count("'loss'") == 2:
            break
    time.sleep(1.0)
    process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    seen += process.communicate(timeout=300)[0]
    assert process.returncode == 0 and "Traceback" not in seen, seen[-3000:]
    assert time.monotonic() - signalled < 30, "the evaluation was not cut short"
    assert "mtk: SIGTERM: the evaluation at step 2 stopped early, not logged" in seen, seen[-3000:]
    assert "eval_loss" not in seen
    read_verified(out / "checkpoint-2")
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"]


def test_a_pipeline_trainer_trains_a_last_partial_batch_as_one_process_does(tmp_path):
    """18 rows at batch 4 x accumulation 2 on PP 2 (4 micro-batches): the last step's batch of 2 rows stopped the run
    after two steps, with advice to use a batch size that is a multiple of 4 (it was). It runs as 2 micro-batches of
    1, said once, and the three steps log the single process's numbers."""
    data = tmp_path / "rows.jsonl"
    rows = (ROOT_PATH / "examples" / "data" / "instructions.jsonl").read_text().splitlines(True)
    data.write_text("".join(rows[:18]))
    args = ["--data", str(data), "--max_steps", "-1", "--num_train_epochs", "1", "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", "2", "--logging_steps", "1", "--save_steps", "3"]  # fmt: skip
    assert _sft(tmp_path / "one", *args).returncode == 0
    out = accelerate_launch("sft.py", "tp1_pp2", "--output_dir", str(tmp_path / "pp"), *args)
    assert "mtk: a batch of 2 sequences runs as 2 micro-batches of 1" in out.stdout + out.stderr

    def logged(run: Path) -> list[tuple[float, float]]:
        history = json.loads((run / "checkpoint-3" / "trainer_state.json").read_text())["log_history"]
        return [(entry["loss"], entry["grad_norm"]) for entry in history if "loss" in entry]

    expected = logged(tmp_path / "one")
    assert len(expected) == 3
    for mine, theirs in zip(logged(tmp_path / "pp"), expected, strict=True):
        assert_close_rel(torch.tensor(mine), torch.tensor(theirs), "pp2 with a last partial batch")
