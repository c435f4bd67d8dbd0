"""A TRL script that changes only its import logs TRL's own numbers at TP2, TP2xPP2 and TP2xDP2.

``tests/e2e/trl_script.py`` is an ordinary SFT/DPO script on a tiny Llama with a BPE chat tokenizer and
conversations whose lengths vary more than 10x (padding, prompt tokens without loss, accumulation 2, TRL's
defaults otherwise: its fused LM head, gradient checkpointing). The reference is TRL's class on one process, or
on two plain ``torchrun`` processes for DP = 2. Every number TRL logs (loss, grad_norm, learning_rate,
entropy, mean_token_accuracy, num_tokens, DPO's rewards/logps/logits, their eval_ twins) must agree within the
exactness bar. The script passes ``model=`` the local directory, as TRL's examples do: under mtk each rank reads only
its slices of it (``tests/e2e/trl_slices_probe.py`` records the reads).
"""

import json
import math
import os
from pathlib import Path

import pytest
from safetensors import safe_open

from mtk.spawn import free_port
from mtk.testing import assert_close_rel
from tests.e2e.conftest import ChatSetup, save_chat_model
from tests.e2e.launch import ROOT, accelerate_launch, run_command

SCRIPT = "tests/e2e/trl_script.py"
PROBE = "tests/e2e/trl_slices_probe.py"  # the same script, recording how each rank got its weights
NOT_COMPARED = ("epoch", "step", "runtime", "per_second", "total_flos")


def _history(out_dir: Path) -> list[dict]:
    return json.loads((out_dir / "log_history.json").read_text())


def _inputs(chat_setup) -> list[str]:
    return ["--model", str(chat_setup.model), "--data", str(chat_setup.data), "--eval_data", str(chat_setup.eval_data)]


def _trl_run(task: str, chat_setup, out_dir: Path, processes: int, *extra: str) -> list[dict]:
    if processes == 1:
        command = ["python", SCRIPT]
    else:
        command = ["torchrun", "--nproc_per_node", str(processes), "--master_port", str(free_port()), SCRIPT]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    args = [task, "--trainer", "trl", *_inputs(chat_setup), "--output_dir", str(out_dir), *extra]
    done = run_command([*command, *args], cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return _history(out_dir)


def _mtk_run(task: str, config: str, chat_setup, out_dir: Path, *extra: str, script: str = SCRIPT) -> list[dict]:
    args = [task, "--trainer", "mtk", *_inputs(chat_setup), "--output_dir", str(out_dir), *extra]
    launch = accelerate_launch(script, config, *args)
    assert "Traceback" not in launch.stderr, launch.stderr[-3000:]
    return _history(out_dir)


def assert_trl_numbers(actual: list[dict], expected: list[dict], what: str) -> None:
    """Every number TRL logged, at every step. A DPO reward is beta x (log-prob - reference log-prob), a
    difference of two sums of about -20 that nearly cancel at the first steps: it is measured against the scale
    of what it is the difference of (beta x |log-probs|), as a rounding of those sums would show."""
    assert [e.get("step") for e in actual] == [e.get("step") for e in expected]
    for mine, theirs in zip(actual, expected):
        keys = [k for k in theirs if not any(part in k for part in NOT_COMPARED)]
        assert sorted(k for k in mine if k in keys) == sorted(keys), (sorted(mine), sorted(keys))
        prefix = "eval_" if any(k.startswith("eval_") for k in keys) else ""
        logps = max(abs(theirs.get(f"{prefix}logps/{side}", 0.0)) for side in ("chosen", "rejected"))
        for key in keys:
            floor = 0.1 * logps if "rewards/" in key else 0.0
            assert_close_rel(mine[key], theirs[key], f"{what}: {key} at step {theirs.get('step')}", scale_floor=floor)


@pytest.fixture(scope="module")
def references(chat_setup, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("trl_reference")
    return {
        ("sft", 1): _trl_run("sft", chat_setup, root / "sft1", 1),
        ("sft", 2): _trl_run("sft", chat_setup, root / "sft2", 2),
        ("sft-packed", 1): _trl_run("sft", chat_setup, root / "sft-packed", 1, "--packing"),
        ("dpo", 1): _trl_run("dpo", chat_setup, root / "dpo1", 1),
        ("dpo", 2): _trl_run("dpo", chat_setup, root / "dpo2", 2),
    }


@pytest.mark.parametrize(
    "task, config, extra, dp",
    [
        ("sft", "tp2", (), 1),
        ("sft", "tp2_pp2", (), 1),
        ("sft", "tp2_dp2", (), 2),
        ("sft", "tp2_dp2_zero2", ("--deepspeed", "ds_configs/accelerate_zero3_tp2.json"), 2),
        ("sft", "tp2", ("--packing",), 1),
        ("sft", "tp2_cp2", ("--packing",), 1),
        ("dpo", "tp2", (), 1),
        ("dpo", "tp2_dp2", (), 2),
        ("dpo", "tp2_pp2", (), 1),
        ("dpo", "tp2_cp2", (), 1),
        ("dpo", "tp2_cp2_pp2", (), 1),
    ],
    ids=[
        "sft-tp2",
        "sft-tp2_pp2",
        "sft-tp2_dp2",
        "sft-zero3-tp2_dp2",
        "sft-packed-tp2",
        "sft-packed-tp2_cp2",
        "dpo-tp2",
        "dpo-tp2_dp2",
        "dpo-tp2_pp2",
        "dpo-tp2_cp2",
        "dpo-tp2_cp2_pp2",
    ],
)
def test_a_trl_script_with_mtks_import_logs_trls_numbers(references, chat_setup, tmp_path, task, config, extra, dp):
    """SFT packing is TRL's padding-free BFD packing (one row per batch, position ids restart per example). ZeRO-3
    from TrainingArguments.deepspeed with ``model=`` a directory: it was built inside DeepSpeed's ``zero.Init``
    (its meta-device build too) and refused as a config transformers cannot build."""
    expected = references[(task + ("-packed" if "--packing" in extra else ""), dp)]
    ours = _mtk_run(task, config, chat_setup, tmp_path / "run", *extra)
    assert_trl_numbers(ours, expected, f"{task} {config} {' '.join(extra)}")


def _tensor_bytes(model_dir: Path) -> tuple[int, int]:
    """Bytes of all tensors in the directory's safetensors, and of the norms (replicated: every TP rank reads them)."""
    with safe_open(model_dir / "model.safetensors", "pt") as handle:
        sizes = {k: math.prod(handle.get_slice(k).get_shape()) * 4 for k in handle.keys()}  # fp32
    return sum(sizes.values()), sum(n for k, n in sizes.items() if k.endswith("norm.weight"))


@pytest.mark.parametrize("task", ["sft", "dpo"])
def test_model_given_as_a_directory_reads_only_this_ranks_slices(references, chat_setup, tmp_path, task):
    """``model=`` the chat set-up's local directory at TP2 (DPO: and TRL's reference copy from it): TRL's
    ``from_pretrained`` never runs; each rank reads from the safetensors at most the bytes its parameters hold (a
    padded vocabulary row is not read), the two ranks together every tensor once plus the replicated norms twice
    (per model); and the run logs TRL's single-process numbers."""
    ours = _mtk_run(task, "tp2", chat_setup, tmp_path / "run", script=PROBE)
    assert_trl_numbers(ours, references[(task, 1)], f"{task} tp2, model= a directory")
    records = [json.loads((tmp_path / "run" / f"loading-rank{rank}.json").read_text()) for rank in (0, 1)]
    models = 2 if task == "dpo" else 1
    for record in records:
        assert record["from_pretrained"] == 0 and record["on_meta"] == 0, record
        assert record["reference_bytes"] == (record["model_bytes"] if task == "dpo" else 0), record
        assert record["safetensors_bytes"] <= record["model_bytes"] + record["reference_bytes"], record
    full, norms = _tensor_bytes(chat_setup.model)
    assert sum(r["safetensors_bytes"] for r in records) == models * (full + norms)
    assert all(r["model_bytes"] < 0.51 * full + norms for r in records)


def test_dpo_with_a_pipeline_and_dropout_is_refused_in_one_line(chat_setup, tmp_path):
    """The pipeline's DPO runs each policy forward twice (log-probabilities, then the gradient): with dropout on,
    the two would differ, so it is one line, not a silently different gradient."""
    args = ["dpo", "--trainer", "mtk", *_inputs(chat_setup), "--output_dir", str(tmp_path / "run"), "--dropout"]
    launch = accelerate_launch(SCRIPT, "tp1_pp2", *args, check=False)
    assert launch.returncode != 0
    assert "DPOConfig.disable_dropout=False with pp > 1" in launch.stderr, launch.stderr[-3000:]


@pytest.mark.parametrize("task", ["sft", "dpo"])
def test_an_moe_model_at_expert_parallelism_logs_trls_numbers(chat_setup, tmp_path, task):
    """TRL's SFTTrainer and DPOTrainer (its reference model spread alike) on a tiny Qwen3-MoE (its load-balancing
    term in the loss) at accelerate_configs/ep2.yaml: the experts spread over the 2 DP ranks, tokens exchanged by
    all-to-all. EP is carved out of DP, so the reference is TRL on 2 plain torchrun processes: every number TRL logs
    agrees."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_setup.model)
    moe = save_chat_model("tiny-qwen3-moe", tokenizer, tmp_path / "moe")
    setup = ChatSetup(moe, chat_setup.data, chat_setup.eval_data)
    expected = _trl_run(task, setup, tmp_path / "trl", 2)
    ours = _mtk_run(task, "ep2", setup, tmp_path / "mtk")
    assert_trl_numbers(ours, expected, f"{task} ep2")
