"""Pipeline parallelism as users run it: ``accelerate launch --config_file accelerate_configs/tp2_pp2.yaml
examples/finetune.py``, resume, resharded resume across PP sizes, ``mtk export`` and ``save_pretrained``.

The model is the tied-embedding Qwen2 (the hardest case for stages: the embedding on the first stage
and the head on the last are one parameter). Every layout must log the single-process losses.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from mtk.models import builtin_config
from mtk.testing import assert_close_rel
from tests.e2e.launch import accelerate_launch, assert_same_losses, one_line_error, run_command, step_losses

MODEL = ("--model", "tiny-qwen2")


def finetune(config: str, out_dir, *args: str) -> dict[int, float]:
    return step_losses(accelerate_launch("finetune.py", config, *MODEL, "--output_dir", str(out_dir), *args))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Single process and TP2 x PP2 (4 micro-batches, 1F1B): 6 steps, checkpoints at 3 and 6."""
    root = tmp_path_factory.mktemp("pp")
    tp1 = finetune("tp1", root / "tp1", "--max_steps", "6", "--save_every", "3")
    pp = finetune(
        "tp2_pp2", root / "tp2_pp2", "--max_steps", "6", "--save_every", "3", "--save_model", str(root / "saved")
    )
    return root, tp1, pp


def test_tp2_pp2_logs_the_single_process_losses(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, tp1, pp = runs
    assert_same_losses(pp, tp1, range(1, 7), "tp2_pp2")
    events = EventAccumulator(str(root / "tp2_pp2" / "runs"))  # written by rank 0: the first stage
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("train/loss")}
    assert_same_losses(logged, tp1, range(1, 7), "tensorboard train/loss of tp2_pp2")
    step3 = root / "tp2_pp2" / "step_3"
    assert sorted(p.name for p in (step3 / "model").iterdir()) == [
        f"tp{t:02d}-pp{p:02d}.safetensors" for t in range(2) for p in range(2)
    ]
    assert json.loads((step3 / "metadata.json").read_text())["topology"] == {"world": 4, "tp": 2, "pp": 2, "dp": 1}


def test_dp_and_gradient_accumulation_with_pipeline_equal_the_same_global_batch(runs, tmp_path, monkeypatch):
    """Against batch 8 on one process: 8 processes (TP2 x PP2 x DP2) with 4 sequences per replica in
    4 micro-batches of 1; PP2 with the AFAB schedule accumulating 2 batches of 4."""
    tp1 = runs[1]
    full = finetune("tp2_pp2_dp2", tmp_path / "b", "--max_steps", "6", "--batch_size", "4")
    assert_same_losses(full, tp1, range(1, 7), "tp2_pp2_dp2")
    monkeypatch.setenv("MTK_PIPELINE_SCHEDULE", "1f1b")  # the flag wins over the launcher's variable
    args = ("--max_steps", "6", "--batch_size", "4", "--grad_accum", "2", "--pipeline_schedule", "afab")
    out = accelerate_launch("finetune.py", "tp1_pp2", *MODEL, "--output_dir", str(tmp_path / "c"), *args)
    assert "mtk: pipeline_schedule=afab (explicit) overrides MTK_PIPELINE_SCHEDULE=1f1b" in out.stderr
    accumulated = step_losses(out)
    assert_same_losses(accumulated, tp1, range(1, 7), "tp1_pp2 (afab) with 2 accumulation steps")


@pytest.mark.parametrize("config", ["tp2_pp2", "tp1"])
def test_resume_pipeline_checkpoint(runs, tmp_path, config):
    """Same layout; PP 2->1 with TP 2->1. The tied copies stay tied."""
    root, _, pp = runs
    resumed = finetune(config, tmp_path, "--max_steps", "6", "--resume", str(root / "tp2_pp2" / "step_3"))
    assert_same_losses(resumed, pp, [4, 5, 6], f"resumed at {config}")


def test_resume_single_process_checkpoint_with_pipeline(runs, tmp_path):
    """PP 1->2: the last stage's head is restored from the embedding (one tensor in the checkpoint)."""
    root, tp1, _ = runs
    resumed = finetune("tp1_pp2", tmp_path, "--max_steps", "6", "--resume", str(root / "tp1" / "step_3"))
    assert_same_losses(resumed, tp1, [4, 5, 6], "tp1 checkpoint resumed at tp1_pp2")


def test_export_and_save_pretrained_of_a_pipeline_run(runs, tmp_path):
    root, _, _ = runs
    for name in ("tp2_pp2", "tp1"):
        out = run_command(["mtk", "export", str(root / name / "step_6"), str(tmp_path / name)])
        assert out.returncode == 0, out.stderr[-2000:]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "tp2_pp2")
    single = AutoModelForCausalLM.from_pretrained(tmp_path / "tp1")
    saved = AutoModelForCausalLM.from_pretrained(root / "saved")  # save_pretrained(get_state_dict) on rank 0
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr(), "still tied"
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = single(ids).logits
        assert_close_rel(exported(ids).logits, expected, "exported tp2_pp2 vs exported tp1")
        assert_close_rel(saved(ids).logits, expected, "save_pretrained of tp2_pp2 vs exported tp1")


def test_a_batch_the_micro_batches_do_not_divide_runs_exactly(tmp_path):
    """Batch 6 at 4 micro-batches (or a data set's last, partial batch, which the Trainer keeps) stopped the run
    mid-way (at the last batch, with no checkpoint of the steps before). finetune.py's loss is token-weighted, so it
    runs as 4 micro-batches of 2, 2, 1 and 1 (a prime batch as one micro-batch would hold m times a step's
    activations) and keeps the single-process losses; a mean of micro-batch means runs as fewer, equal ones, said
    (tests/e2e/test_trainer_safety.py)."""
    args = ("--max_steps", "2", "--batch_size", "6")
    tp1 = finetune("tp1", tmp_path / "tp1", *args)
    out = accelerate_launch("finetune.py", "tp1_pp2", *MODEL, "--output_dir", str(tmp_path / "pp2"), *args)
    assert "micro-batches of" not in out.stdout, out.stdout[-3000:]
    assert_same_losses(step_losses(out), tp1, [1, 2], "batch 6 as 4 micro-batches")


def test_bad_pipeline_input_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MTK_PIPELINE_LAYERS", "2,1")
    out = accelerate_launch("finetune.py", "tp1_pp2", "--output_dir", str(tmp_path), check=False)
    one_line_error(
        out,
        "pipeline layers [2, 1] must be 2 positive counts (one per stage, or per model chunk with virtual stages) "
        "summing to the model's 2 layers",
    )
    assert not list(tmp_path.glob("step_*")), "nothing that looks like a checkpoint"


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """A 4-layer tied Qwen2 (pp 2 x 2 virtual stages: one layer per chunk) run on one process, saved at 3."""
    root = tmp_path_factory.mktemp("interleaved")
    config = builtin_config("tiny-qwen2")
    config.num_hidden_layers, config.layer_types = 4, [config.layer_types[0]] * 4
    model = root / "four-layer-qwen2.json"
    model.write_text(config.to_json_string())
    out = accelerate_launch(
        "finetune.py",
        "tp1",
        "--model",
        str(model),
        "--output_dir",
        str(root / "tp1"),
        "--max_steps",
        "6",
        "--save_every",
        "3",
    )
    return root, model, step_losses(out)


INTERLEAVED = ("--pipeline_schedule", "interleaved", "--virtual_stages", "2")


def test_interleaved_schedule_trains_resumes_and_reshards_like_one_process(four_layers, tmp_path):
    """TP2 x PP2 with two chunks per rank (the ring wraps from the last rank to the first) logs the
    one-process losses; its checkpoint resumes on one process (same HF-named files), and the
    one-process checkpoint resumes interleaved at PP 2."""
    root, model, tp1 = four_layers
    out = accelerate_launch(
        "finetune.py",
        "tp2_pp2",
        "--model",
        str(model),
        "--output_dir",
        str(tmp_path / "il"),
        "--max_steps",
        "6",
        "--save_every",
        "3",
        *INTERLEAVED,
    )
    assert "pp=2 (interleaved x 2 chunks, 4 micro-batches)" in out.stdout
    assert_same_losses(step_losses(out), tp1, range(1, 7), "tp2_pp2 interleaved")
    step3 = tmp_path / "il" / "step_3"
    assert sorted(p.name for p in (step3 / "model").iterdir()) == [
        f"tp{t:02d}-pp{p:02d}.safetensors" for t in range(2) for p in range(2)
    ]
    resumed = step_losses(
        accelerate_launch(
            "finetune.py",
            "tp1",
            "--model",
            str(model),
            "--output_dir",
            str(tmp_path / "r1"),
            "--max_steps",
            "6",
            "--resume",
            str(step3),
        )
    )
    assert_same_losses(resumed, tp1, [4, 5, 6], "interleaved checkpoint resumed on one process")
    resumed = step_losses(
        accelerate_launch(
            "finetune.py",
            "tp1_pp2",
            "--model",
            str(model),
            "--output_dir",
            str(tmp_path / "r2"),
            "--max_steps",
            "6",
            "--resume",
            str(root / "tp1" / "step_3"),
            *INTERLEAVED,
        )
    )
    assert_same_losses(resumed, tp1, [4, 5, 6], "one-process checkpoint resumed interleaved")
    for name, checkpoint in (("il", step3), ("tp1", root / "tp1" / "step_3")):
        out = run_command(["mtk", "export", str(checkpoint), str(tmp_path / f"export-{name}")])
        assert out.returncode == 0, out.stderr[-2000:]
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export-il")(ids).logits
        expected = AutoModelForCausalLM.from_pretrained(tmp_path / "export-tp1")(ids).logits
    assert_close_rel(exported, expected, "exported interleaved checkpoint vs exported one-process checkpoint")


def test_interleaved_runs_a_batch_no_equal_split_fits_in_uneven_micro_batches_exactly(four_layers, tmp_path):
    """Batch 3 at the interleaved schedule (pp 2 x v 2, 4 micro-batches): no equal split comes in groups of 2, so it
    runs as micro-batches of 2 and 1; the loss is token-weighted (finetune.py passes the batch's token count), so
    the one-process losses hold. It stopped the run where such a batch came (a Trainer's last, partial one). A batch
    of one row runs with a copy whose labels are ignored."""
    _, model, _ = four_layers
    args = ("--model", str(model), "--max_steps", "2", "--batch_size", "3")
    tp1 = step_losses(accelerate_launch("finetune.py", "tp1", *args, "--output_dir", str(tmp_path / "tp1")))
    pp = accelerate_launch("finetune.py", "tp1_pp2", *args, *INTERLEAVED, "--output_dir", str(tmp_path / "pp"))
    assert "mtk: a batch of 3 sequences runs as 2 micro-batches of 1 or 2: megatron_lm_num_micro_batches" in pp.stdout
    assert_same_losses(step_losses(pp), tp1, [1, 2], "interleaved batch 3 as 2 + 1")
    # one row (a last batch of one, an evaluation's): its copy fills the group of pp, labels ignored
    args = ("--model", str(model), "--max_steps", "2", "--batch_size", "1")
    tp1 = step_losses(accelerate_launch("finetune.py", "tp1", *args, "--output_dir", str(tmp_path / "tp1_1")))
    pp = accelerate_launch("finetune.py", "tp1_pp2", *args, *INTERLEAVED, "--output_dir", str(tmp_path / "pp_1"))
    assert "with 1 row(s) copied and ignored (no loss, no gradient)" in pp.stdout, pp.stdout[-2000:]
    assert_same_losses(step_losses(pp), tp1, [1, 2], "interleaved batch 1 with an ignored copy")


def test_bad_interleaved_input_is_one_clear_line(four_layers, tmp_path):
    _, model, _ = four_layers
    base = ("finetune.py", "tp1_pp2", "--model", str(model), "--output_dir", str(tmp_path))
    out = accelerate_launch(*base, "--pipeline_schedule", "interleaved", check=False)
    one_line_error(out, "the interleaved schedule needs virtual_stages >= 2 (model chunks per pipeline rank), e.g. 2")
    out = accelerate_launch(*base, "--virtual_stages", "2", check=False)
    one_line_error(out, "virtual_stages = 2 needs the interleaved schedule (pipeline_schedule interleaved)")
    out = accelerate_launch(*base, *INTERLEAVED, "--pipeline_layers", "3,1", check=False)
    one_line_error(out, "pipeline layers [3, 1] must be 4 positive counts (one per stage, or per model chunk")
    assert not list(tmp_path.glob("step_*")), "nothing that looks like a checkpoint"
