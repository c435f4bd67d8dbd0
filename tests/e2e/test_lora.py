"""LoRA as users run it: ``accelerate launch ... examples/finetune.py --lora_r 8 --lora_targets all-linear``.

On a local model directory with its tokenizer and chat data: TP=1 and TP=2 log the same losses, the
TP=2 checkpoint holds only the adapters (a small fraction of a full one), resumes at another layout
exactly, and ``mtk export --adapter`` writes a directory that ``PeftModel.from_pretrained`` loads on the
base directory, equal to what ``save_pretrained`` on the unwrapped model wrote; ``--merge`` loads with
``from_pretrained``. Bad LoRA options are one line each.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.conftest import Run
from tests.e2e.launch import ROOT, accelerate_launch, assert_same_losses, one_line_error, run_command, step_losses

LORA = ("--lora_r", "8", "--lora_targets", "all-linear", "--lora_alpha", "16")


def _lora_run(tmp_path_factory, chat_setup, config: str, *args: str) -> Run:
    out_dir = tmp_path_factory.mktemp(f"lora_{config}")
    out = accelerate_launch(
        "finetune.py",
        config,
        "--model",
        str(chat_setup.model),
        "--data",
        str(chat_setup.data),
        "--output_dir",
        str(out_dir),
        "--max_steps",
        "6",
        "--save_every",
        "3",
        "--save_model",
        str(out_dir / "saved"),  # save_pretrained on the unwrapped PeftModel
        *LORA,
        *args,
    )
    return Run(out_dir, step_losses(out))


@pytest.fixture(scope="module")
def lora_tp1(tmp_path_factory, chat_setup) -> Run:
    return _lora_run(tmp_path_factory, chat_setup, "tp1")


@pytest.fixture(scope="module")
def lora_tp2(tmp_path_factory, chat_setup) -> Run:
    return _lora_run(tmp_path_factory, chat_setup, "tp2")


def test_tp2_logs_the_tp1_losses(lora_tp1, lora_tp2):
    assert_same_losses(lora_tp2.losses, lora_tp1.losses, range(1, 7), "LoRA TP=2 vs TP=1")
    assert lora_tp1.losses[6] < lora_tp1.losses[1]  # the adapters learn


def test_fsdp2_shards_the_frozen_base_and_logs_the_tp1_losses(lora_tp1, tmp_path_factory, chat_setup):
    """tp2_fsdp2.yaml (TP2 x FSDP2 over DP2, half the micro-batch: the same global batch): the frozen base and the
    adapters split over DP too; the same losses, and save_pretrained writes the same adapters as TP=1."""
    from safetensors.torch import load_file

    from mtk.testing import assert_close_rel

    run = _lora_run(tmp_path_factory, chat_setup, "tp2_fsdp2", "--batch_size", "4")
    assert_same_losses(run.losses, lora_tp1.losses, range(1, 7), "LoRA TP=2 x FSDP2 vs TP=1")
    saved = load_file(str(run.dir / "saved" / "adapter_model.safetensors"))
    reference = load_file(str(lora_tp1.dir / "saved" / "adapter_model.safetensors"))
    assert sorted(saved) == sorted(reference)
    for name, tensor in reference.items():
        # after six AdamW steps in fp32: Adam divides each entry's step by its own gradient's size, so an entry whose
        # gradient nearly cancels carries fp32's relative rounding into its step (lora_B starts at zero: the whole
        # tensor is such steps; 1.2e-4 on an AVX2 CPU). The losses above hold the 1e-5 bar
        assert_close_rel(saved[name], tensor, f"{name} saved after TP=2 x FSDP2", tol=3e-4)


@pytest.mark.parametrize("config", ["tp2_cp2", "tp2_pp2"])
def test_tp2_cp2_and_pp2_log_the_tp1_losses_and_save_the_same_adapters(lora_tp1, tmp_path_factory, chat_setup, config):
    """tp2_cp2.yaml: PEFT's adapters on the TP layers of a model whose rows split over CP = 2. tp2_pp2.yaml: each
    rank's PeftModel holds its stage's layers; save_pretrained of the gathered state wrote only the first stage's
    adapters (PEFT keeps the layers it finds), which PEFT loaded without a word."""
    from safetensors.torch import load_file

    from mtk.testing import assert_close_rel

    run = _lora_run(tmp_path_factory, chat_setup, config)
    assert_same_losses(run.losses, lora_tp1.losses, range(1, 7), f"LoRA {config} vs TP=1")
    saved = load_file(str(run.dir / "saved" / "adapter_model.safetensors"))
    reference = load_file(str(lora_tp1.dir / "saved" / "adapter_model.safetensors"))
    assert sorted(saved) == sorted(reference)
    for name, tensor in reference.items():
        assert_close_rel(saved[name], tensor, f"{name} saved after {config}", tol=3e-4)  # see above


def _bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def test_checkpoint_holds_only_the_adapters(lora_tp2, chat_setup):
    import json

    from safetensors import safe_open

    step = lora_tp2.dir / "step_6"
    for shard in (step / "model").glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            assert all(".lora_A." in k or ".lora_B." in k for k in f.keys())
    meta = json.loads((step / "metadata.json").read_text())
    assert meta["base_model"]["name_or_path"] == str(chat_setup.model)
    assert meta["model"]["adapters"]["default"]["r"] == 8
    weights_and_state = _bytes(step / "model") + _bytes(step / "optimizer")
    base = (chat_setup.model / "model.safetensors").stat().st_size
    assert weights_and_state < 0.5 * 3 * base  # a full checkpoint holds the weights and Adam's two moments


def test_resume_at_another_layout(tmp_path, lora_tp2, chat_setup):
    out = accelerate_launch(
        "finetune.py",
        "tp1_pp2",
        "--model",
        str(chat_setup.model),
        "--data",
        str(chat_setup.data),
        "--output_dir",
        str(tmp_path),
        "--max_steps",
        "6",
        "--resume",
        str(lora_tp2.dir / "step_3"),
        *LORA,
    )
    assert_same_losses(step_losses(out), lora_tp2.losses, range(4, 7), "resumed at TP=1 x PP=2")


def _mtk(*args: str) -> subprocess.CompletedProcess:
    return run_command([sys.executable, "-m", "mtk.cli.main", *args], cwd=ROOT, timeout=600)


def test_export_adapter_loads_with_peft(tmp_path, lora_tp2, chat_setup):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = _mtk("export", str(lora_tp2.dir / "step_6"), str(tmp_path / "adapter"), "--adapter")
    assert out.returncode == 0, out.stderr[-2000:]
    exported = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    saved = load_file(str(lora_tp2.dir / "saved" / "adapter_model.safetensors"))
    assert sorted(exported) == sorted(saved) and all(torch.equal(exported[k], saved[k]) for k in saved)
    base = AutoModelForCausalLM.from_pretrained(chat_setup.model)
    model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged_out = _mtk("export", str(lora_tp2.dir / "step_6"), str(tmp_path / "merged"), "--merge")
    assert merged_out.returncode == 0, merged_out.stderr[-2000:]  # the base is the directory the run loaded
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = torch.arange(1, 17).reshape(2, 8)
    with torch.no_grad():
        from mtk.testing import assert_close_rel

        assert_close_rel(merged(input_ids=ids).logits, model(input_ids=ids).logits, "merged vs PEFT logits")
    assert (tmp_path / "merged" / "tokenizer_config.json").is_file()  # the run's tokenizer travels along
    run_generation = (lora_tp2.dir / "step_6" / "generation_config.json").read_text()  # the run's, not the base's
    assert (tmp_path / "merged" / "generation_config.json").read_text() == run_generation
    # --dtype casts the adapters (it was accepted and ignored); --max_shard_size has nothing to shard: one line
    step = str(lora_tp2.dir / "step_6")
    assert _mtk("export", step, str(tmp_path / "bf16"), "--adapter", "--dtype", "bf16").returncode == 0
    cast = load_file(str(tmp_path / "bf16" / "adapter_model.safetensors"))
    assert sorted(cast) == sorted(saved) and all(cast[k].equal(saved[k].to(torch.bfloat16)) for k in saved)
    sharded = _mtk("export", step, str(tmp_path / "sharded"), "--adapter", "--max_shard_size", "1KB")
    assert sharded.returncode == 2 and "--max_shard_size with --adapter: a PEFT adapter directory is one" in (
        sharded.stderr
    )
    assert not (tmp_path / "sharded").exists()
    # --base another architecture: the checkpoint's class was built from its config (a default-size 7B Llama from
    # GPT-2's: killed for memory) before the fingerprint could refuse it; its config is compared first, one line
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    other = _mtk("export", step, str(tmp_path / "other"), "--merge", "--base", str(tmp_path / "gpt2"))
    assert other.returncode == 2 and "is not the base the adapters in" in other.stderr, other.stderr[-2000:]
    assert "(its config differs: model_type gpt2 there, llama trained" in other.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (("--lora_alpha", "16"), "--lora_alpha configure LoRA adapters; add --lora_r R"),
        (("--lora_r", "4", "--lora_targets", "q_proj,nonexistent"), "target(s) nonexistent match no module"),
        (("--lora_r", "4", "--lora_targets", "lm_head"), "vocabulary-parallel output head"),
    ],
)
def test_bad_lora_options_are_one_line(tmp_path, args, message):
    out = accelerate_launch(
        "finetune.py", "tp2", "--output_dir", str(tmp_path), "--max_steps", "1", *args, check=False
    )
    one_line_error(out, message)


def test_deepspeed_zero2_trains_the_same_adapters(tmp_path, lora_tp1, chat_setup):
    """``deepspeed ... run.py --lora_r 8`` with ZeRO-2 over DP at TP=2 x DP=2: the accelerate TP=1 losses; its
    checkpoint (DeepSpeed's own included) leaves the frozen base out."""
    from tests.e2e.test_deepspeed import deepspeed_run

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
        "6",
        "--model",
        str(chat_setup.model),
        "--data",
        str(chat_setup.data),
        "--output_dir",
        str(tmp_path),
        *LORA,
    )
    assert_same_losses(step_losses(out), lora_tp1.losses, range(1, 7), "DeepSpeed ZeRO-2 LoRA")
    base = (chat_setup.model / "model.safetensors").stat().st_size
    assert _bytes(tmp_path / "step_6" / "deepspeed") < base  # adapters and their moments, no base weights
