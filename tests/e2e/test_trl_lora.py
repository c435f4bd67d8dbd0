"""TRL's LoRA runs (``peft_config=``) with mtk's import log TRL's numbers at TP2, save TRL's adapter, resume exactly.

``tests/e2e/trl_script.py --lora`` passes a ``peft.LoraConfig`` (q_proj, v_proj, up_proj; r = 4) to SFT and DPO.
The reference is TRL's own class on one process: PEFT draws the adapters there, and mtk's trainers start its
tensor-parallel adapters from the same draws, so every number TRL logs (DPO's reference log-probabilities come
from the model with its adapters disabled in both) agrees within the exactness bar. The mtk SFT run writes
``checkpoint-2``/``checkpoint-4`` and ``save_model``'s adapter directory; a second run resumes from
``checkpoint-2``. Five launches in all (two of them plain single processes).
"""

import json
from pathlib import Path

import pytest
import torch

from mtk.testing import assert_close_rel
from tests.e2e.test_trl import _history, _mtk_run, _trl_run, assert_trl_numbers

LORA = ("--lora",)
SAVED = ("--save_steps", "2")


@pytest.fixture(scope="module")
def runs(chat_setup, tmp_path_factory) -> Path:
    """TRL's SFT and DPO LoRA runs on one process, mtk's at TP2, and mtk's SFT resumed from its checkpoint-2."""
    root = tmp_path_factory.mktemp("trl_lora")

    def saving(run: str) -> tuple[str, ...]:
        return ("--save_model", str(root / run / "adapter"))

    _trl_run("sft", chat_setup, root / "trl_sft", 1, *LORA, *SAVED, *saving("trl_sft"))
    _trl_run("dpo", chat_setup, root / "trl_dpo", 1, *LORA)
    _mtk_run("sft", "tp2", chat_setup, root / "sft", *LORA, *SAVED, *saving("sft"))
    _mtk_run("dpo", "tp2", chat_setup, root / "dpo", *LORA)
    resume = ("--resume_from_checkpoint", str(root / "sft" / "checkpoint-2"))
    _mtk_run("sft", "tp2", chat_setup, root / "resumed", *LORA, *resume, *saving("resumed"))
    return root


@pytest.mark.parametrize("task", ["sft", "dpo"])
def test_lora_at_tp2_logs_trls_numbers(runs, task):
    assert_trl_numbers(_history(runs / task), _history(runs / f"trl_{task}"), f"LoRA {task} tp2")


def _adapters(directory: Path, base: Path) -> dict[str, torch.Tensor]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), directory)
    return {name: param.detach() for name, param in model.named_parameters() if ".lora_" in name}


def test_save_model_writes_trls_adapter(runs, chat_setup):
    """``save_model``: PEFT's adapter directory, full (unsharded) tensors, equal to what TRL's save_model wrote;
    the checkpoints hold the adapters only."""
    from safetensors import safe_open

    mine, theirs = runs / "sft" / "adapter", runs / "trl_sft" / "adapter"
    configs = [json.loads((d / "adapter_config.json").read_text()) for d in (mine, theirs)]
    for config in configs:
        config["target_modules"] = sorted(config["target_modules"])  # a set, saved in no particular order
    assert configs[0] == configs[1]
    ours, expected = _adapters(mine, chat_setup.model), _adapters(theirs, chat_setup.model)
    assert sorted(ours) == sorted(expected) and len(ours) == 2 * 2 * 3  # 2 layers x 3 targets x (A, B)
    for name, tensor in expected.items():
        assert ours[name].shape == tensor.shape
        assert_close_rel(ours[name], tensor, f"saved {name}")
    for shard in (runs / "sft" / "checkpoint-4" / "model").glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            assert all(".lora_A." in key or ".lora_B." in key for key in f.keys())


def test_resume_from_a_lora_checkpoint_is_exact(runs):
    """Resumed at step 2: the same numbers at steps 3 and 4 and the same saved adapter, bit for bit. Two counters
    restart with the run, as they do when TRL's own trainer resumes: TRL's ``num_tokens`` (kept in memory, not in
    the checkpoint) counts the tokens since the resume, and transformers' final ``train_loss`` is the mean over the
    steps this run trained."""
    from safetensors.torch import load_file

    resumed, whole = _history(runs / "resumed"), _history(runs / "sft")
    before = next(e["num_tokens"] for e in whole if e.get("step") == 2 and "num_tokens" in e)  # at the checkpoint
    for mine, theirs in zip(resumed[:-1], whole[:-1], strict=True):
        expected = {k: v for k, v in theirs.items() if not any(t in k for t in ("runtime", "per_second"))}
        if theirs["step"] > 2:
            for key in ("num_tokens", "eval_num_tokens"):
                if key in expected:
                    expected[key] -= before
        assert {k: mine[k] for k in expected} == expected, theirs["step"]
    losses = [entry["loss"] for entry in whole if entry.get("step") in (3, 4) and "loss" in entry]
    assert_close_rel(resumed[-1]["train_loss"], sum(losses) / len(losses), "resumed train_loss")
    saved = [load_file(str(runs / run / "adapter" / "adapter_model.safetensors")) for run in ("resumed", "sft")]
    assert sorted(saved[0]) == sorted(saved[1])
    assert all(torch.equal(saved[0][name], saved[1][name]) for name in saved[1])


def test_lora_under_zero3_logs_trls_numbers_and_resumes_exactly(chat_setup, tmp_path):
    """LoRA on ``model=`` a directory under ZeRO-3 (TrainingArguments.deepspeed) at TP2 x DP2: TRL's numbers on two
    plain processes, and checkpoint-2 resumed gives the same steps 3 and 4 bit for bit. The directory's meta-device
    builds ran inside DeepSpeed's ``zero.Init`` (a refusal, then a traceback), and the frozen base's fingerprint
    read ZeRO-3's empty placeholders (sum 0: a valid resume refused as another base)."""
    zero3 = ("--deepspeed", "ds_configs/accelerate_zero3_tp2.json")
    expected = _trl_run("sft", chat_setup, tmp_path / "trl", 2, *LORA)
    ours = _mtk_run("sft", "tp2_dp2_zero2", chat_setup, tmp_path / "run", *LORA, *zero3, *SAVED)
    assert_trl_numbers(ours, expected, "LoRA sft zero3 tp2_dp2")
    resume = ("--resume_from_checkpoint", str(tmp_path / "run" / "checkpoint-2"))
    resumed = _mtk_run("sft", "tp2_dp2_zero2", chat_setup, tmp_path / "resumed", *LORA, *zero3, *resume)
    later = [[e.get("loss"), e.get("grad_norm")] for e in ours if e.get("step") in (3, 4) and "loss" in e]
    assert len(later) == 2
    assert [[e.get("loss"), e.get("grad_norm")] for e in resumed if e.get("step") in (3, 4) and "loss" in e] == later


def test_resuming_with_other_lora_settings_is_one_line(runs, chat_setup, tmp_path):
    """``checkpoint-2`` (lora_alpha 8) resumed with ``lora_alpha=32``: the adapters have the same shapes, so it
    trained another model from step 3 without a word (mtk's scripts guarded their flags, nothing the Trainer's
    ``peft_config``). Each rank refuses it before loading anything, naming the setting."""
    from tests.e2e.launch import accelerate_launch
    from tests.e2e.test_trl import _inputs

    resume = ("--resume_from_checkpoint", str(runs / "sft" / "checkpoint-2"))
    args = ["sft", "--trainer", "mtk", *_inputs(chat_setup), "--output_dir", str(tmp_path / "out"), *LORA, *resume]
    launch = accelerate_launch("tests/e2e/trl_script.py", "tp2", *args, "--lora_alpha", "32", check=False)
    assert launch.returncode != 0 and "Traceback" not in launch.stderr.split("ChildFailedError")[0], launch.stderr
    said = "this run changes lora_alpha 8 -> 32.0 of the adapter 'default' from the checkpoint it resumes"
    assert said in launch.stderr, launch.stderr[-3000:]


def test_a_peft_model_is_refused_in_one_line(chat_setup, tmp_path):
    """A ``PeftModel`` wraps layers mtk has not converted: refused before TRL loads or prepares anything."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig

    from mtk.errors import ConfigError
    from mtk.trainers import SFTTrainer

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(chat_setup.model), LoraConfig(r=4))
    with pytest.raises(ConfigError, match=r"pass the base model with peft_config=") as err:
        config = SFTConfig(output_dir=str(tmp_path), report_to=[], bf16=False, use_cpu=True)
        SFTTrainer(model, args=config, train_dataset=None)
    assert "\n" not in str(err.value)
