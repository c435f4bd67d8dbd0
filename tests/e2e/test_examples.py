"""The example scripts run as users type them (on the tiny default models)."""

import json
import sys
from pathlib import Path

import pytest
import torch

from mtk.checkpoint.integrity import read_verified
from tests.e2e.launch import accelerate_launch, one_line_error, run_command

ROOT = Path(__file__).resolve().parents[2]


def _benchmark(script: str, *args: str) -> str:
    """``python examples/benchmarks/<script> <args>`` from the repository root; its stdout once it succeeded."""
    out = run_command([sys.executable, f"examples/benchmarks/{script}", *args], cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_load_memory_example_runs_on_a_tiny_model():
    out = _benchmark("load_memory.py", "--model", "tiny-llama", "--tp", "2")
    assert "full HF load" in out and "mtk tp=2 load, rank 1" in out


def test_chunked_loss_benchmark_runs_on_a_tiny_model(tmp_path):
    args = [
        "--model",
        "tiny-llama",
        "--seqs",
        "64",
        "--chunk",
        "16",
        "--steps",
        "1",
        "--json",
        str(tmp_path / "l.json"),
        "--fork_workers",  # (the live bytes it checks are the same; the bench's fresh processes: test_bench.py)
    ]
    out = _benchmark("chunked_loss.py", *args)
    assert "logits kept" in out and "chunked 16" in out
    rows = json.loads((tmp_path / "l.json").read_text())["rows"]["64"]
    assert set(rows) == {"logits kept", "chunked", "chunked 16"}
    kept = rows["logits kept"]["activations_mib"]  # the logits and their softmax, held for backward, are gone:
    assert rows["chunked"]["activations_mib"] < kept and rows["chunked 16"]["activations_mib"] < kept


def _classify(out_dir, *extra):
    out = accelerate_launch(
        "classify.py", "tp2", "--max_steps", "60", "--save_every", "30", "--output_dir", str(out_dir), *extra
    )
    return out.stdout + out.stderr


def test_bert_classification_example_trains_resumes_and_saves(tmp_path):
    import re

    import torch
    from transformers import AutoModelForSequenceClassification

    from mtk.testing import assert_close_rel

    full = _classify(tmp_path / "full")
    accuracy = float(re.search(r"eval accuracy (\S+)", full).group(1))
    assert accuracy > 0.8, full[-2000:]
    resumed = _classify(tmp_path / "resumed", "--resume", str(tmp_path / "full" / "step_30"))
    full_losses = dict(re.findall(r"step (\d+) loss (\S+)", full))
    resumed_losses = dict(re.findall(r"step (\d+) loss (\S+)", resumed))
    assert sorted(resumed_losses) == ["40", "50", "60"]
    for step, loss in resumed_losses.items():
        assert_close_rel(float(loss), float(full_losses[step]), f"loss at step {step} after resume")

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "full" / "model")
    assert model.bert.embeddings.word_embeddings.weight.shape == (259, 64), "no vocabulary padding saved"
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 2)


def test_a_non_finite_gradient_stops_the_classification_run_before_it_is_saved(tmp_path):
    from tests.e2e.launch import one_line_error

    out = accelerate_launch("classify.py", "tp1", "--lr", "1e30", "--max_steps", "5", "--save_every", "1",
                            "--output_dir", str(tmp_path), check=False)  # fmt: skip
    one_line_error(out, "stopped before non-finite weights are saved", prog="classify.py")
    saved = sorted(p.name for p in tmp_path.glob("step_*"))
    assert saved == [f"step_{n}" for n in range(1, len(saved) + 1)] and len(saved) < 5, saved  # all finite ones


def test_classify_refuses_before_training_a_model_folder_whose_shards_its_save_would_delete(tmp_path):
    """classify.py ends with transformers' own save_pretrained into --output_dir/model, which deletes weight shards
    it does not rewrite: a folder holding someone's shards is one line before any step, and they stay."""
    from tests.e2e.launch import one_line_error

    theirs = tmp_path / "model" / "model-00001-of-00002.safetensors"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(b"someone's")
    out = accelerate_launch("classify.py", "tp1", "--max_steps", "5", "--output_dir", str(tmp_path), check=False)
    one_line_error(out, "that transformers' save_pretrained would delete", prog="classify.py")
    assert theirs.read_bytes() == b"someone's" and not list(tmp_path.glob("step_*"))


def test_classify_refuses_a_built_in_causal_lm_in_one_line(tmp_path):
    """A built-in decoder name (tiny-llama) built a causal LM, whose loss took the per-row labels: a traceback."""
    from tests.e2e.launch import one_line_error

    out = accelerate_launch("classify.py", "tp1", "--model", "tiny-llama", "--output_dir", str(tmp_path), check=False)
    one_line_error(
        out, "--model tiny-llama is a built-in llama causal LM, which classify.py does not train", prog="classify.py"
    )


def test_classify_with_fewer_rows_than_a_batch_is_one_line(tmp_path):
    """4 training rows at --batch_size 16 (the loader drops a partial batch): no batch at all, and the epoch
    arithmetic divided by zero (a traceback). One line, before training, nothing written."""
    from tests.e2e.launch import one_line_error

    data = tmp_path / "rows.csv"
    data.write_text("text,label\na b,0\nc d,1\ne f,0\ng h,1\n")
    common = ("--data", str(data), "--eval_data", str(data), "--output_dir", str(tmp_path / "out"))
    out = accelerate_launch("classify.py", "tp1", *common, check=False)
    one_line_error(
        out, "--data has 4 training rows, fewer than one batch of --batch_size 16; use a smaller", prog="classify.py"
    )
    assert not (tmp_path / "out").exists()


def test_classification_of_a_local_bert_with_its_tokenizer_and_named_labels(tmp_path):
    """The real-model path without a download: a BERT directory (an encoder without a head, as
    all-MiniLM-L6-v2 ships) with a BPE tokenizer, labels as names in .jsonl files, held-out --eval_data; saved
    only at the end (--save_every 0, as finetune.py takes it)."""
    import csv
    import json
    import re

    from transformers import AutoConfig, BertModel

    from mtk.models import builtin_config
    from mtk.testing import train_chat_tokenizer

    rows = list(csv.DictReader((ROOT / "examples" / "data" / "sentiment.csv").open()))
    names = {"0": "negative", "1": "positive"}
    tokenizer = train_chat_tokenizer([row["text"] for row in rows], vocab_size=300)
    config = builtin_config("tiny-bert")
    config.vocab_size, config.pad_token_id = len(tokenizer), tokenizer.pad_token_id
    BertModel(config).save_pretrained(tmp_path / "bert")
    tokenizer.save_pretrained(tmp_path / "bert")
    for name, part in (("train", rows[:256]), ("eval", rows[256:])):
        lines = [json.dumps({"text": row["text"], "label": names[row["label"]]}) for row in part]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    out = accelerate_launch(
        "classify.py", "tp2", "--model", str(tmp_path / "bert"), "--data", str(tmp_path / "train.jsonl"),
        "--eval_data", str(tmp_path / "eval.jsonl"), "--max_steps", "60", "--save_every", "0",
        "--output_dir", str(tmp_path / "run"),
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert "mtk: 256 training and 64 evaluation sentences, 2 labels" in text, text[-2000:]
    assert float(re.search(r"eval accuracy (\S+)", text).group(1)) > 0.8, text[-2000:]
    saved = AutoConfig.from_pretrained(tmp_path / "run" / "model")
    assert saved.id2label == {0: "negative", 1: "positive"}
    assert [p.name for p in (tmp_path / "run").glob("step_*")] == ["step_60"]  # --save_every 0: at the end only


@pytest.mark.parametrize(
    "script, config", [("sft.py", "tp2_pp2"), ("dpo.py", "tp2")], ids=["sft at tp2_pp2", "dpo at tp2"]
)
def test_trl_examples_run_as_documented_and_save_a_model(tmp_path, script, config):
    """The README's SFT and DPO commands (on their built-in defaults, a few steps): TRL's logs, a saved model."""
    out = tmp_path / "run"
    done = accelerate_launch(script, config, "--output_dir", str(out), "--max_steps", "4", "--logging_steps", "2")
    assert "'loss'" in done.stdout + done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert read_verified(out / "checkpoint-4").step == 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["--foo", "1"], "not used by the HfArgumentParser: ['--foo', '1']; check the spelling; --help lists"),
        (["--eval_strategy", "steps", "--eval_steps", "1"], "you didn't pass an `eval_dataset`"),
        (["--optim", "galore_adamw"], "You need to install `galore_torch` in order to use GaLore optimizers"),
        (["--weight_decay=nan"], "TrainingArguments.weight_decay=nan: must be a finite number"),
        (["--output_dir", "{file}"], "is an existing file: checkpoints and the model are saved into a folder"),
        (["--lr_scheduler_type", "warmup_stable_decay"], "missing 1 required positional argument: 'num_decay_steps'"),
        (["--deepspeed", "{folder}"], "Is a directory: '{folder}'; a folder was given where a file is wanted"),
        (["--data", "{broken}"], "could not be read as json (broken.jsonl line 2, column 2: Expecting property name"),
        (["--eval_on_start", "True"], "eval_on_start needs an eval_dataset"),
        (["--data", "{folder}", "--output_dir", "{folder}"], "is inside the --data folder {folder}; the run would"),
        (["--bf16", "True"], "to train the model on CPU; this machine has no accelerator: add --use_cpu True (bf16"),
    ],
    ids=[
        "unknown flag", "eval without data", "optimizer not installed", "nan", "output_dir a file",
        "a scheduler's setting left out", "deepspeed a folder", "data not JSON", "eval_on_start without data",
        "output_dir the data folder", "bf16 without an accelerator",
    ],
)  # fmt: skip
def test_a_setting_the_trl_examples_libraries_refuse_is_one_line(tmp_path, args, message):
    """What transformers, TRL or torch refuse while sft.py sets up (parsing, the arguments, the trainer, its
    optimizer) and what mtk refuses in the arguments: one ``sft.py: error:`` line, exit status 2, no traceback.
    One process: each is refused before any training, as at any layout."""
    import importlib.util

    if "galore_adamw" in args and importlib.util.find_spec("galore_torch") is not None:
        pytest.skip("galore_torch is installed here")
    if "--bf16" in args and torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator: bf16 runs")
    taken = tmp_path / "file"
    taken.write_text("kept")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a"}\n{not json\n')
    names = {"{file}": str(taken), "{folder}": str(tmp_path), "{broken}": str(broken)}
    args = [names.get(arg, arg) for arg in args]
    message = message.replace("{folder}", str(tmp_path))
    command = [sys.executable, "examples/sft.py", "--max_steps", "2", "--output_dir", str(tmp_path / "run"), *args]
    done = run_command(command, cwd=ROOT, timeout=600)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    one_line_error(done, message, prog="sft.py")
    assert taken.read_text() == "kept" and not (tmp_path / "run" / "model.safetensors").exists()
