"""Export and resharded resume, as users run them: accelerate launch ... and mtk export."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from mtk.testing import assert_close_rel
from tests.e2e.launch import ROOT, finetune, run_command


def mtk_export(*args: str) -> subprocess.CompletedProcess:
    return run_command(["mtk", "export", *args], timeout=600)


@pytest.fixture(scope="module")
def runs(llama_tp1, llama_tp2):
    """The shared TP=2 and TP=1 reference runs (tests/e2e/conftest.py), by layout name."""
    return {"tp2": llama_tp2, "tp1": llama_tp1}


def test_exported_tp2_run_equals_exported_tp1_run(runs, tmp_path):
    for name in ("tp2", "tp1"):
        out = mtk_export(str(runs[name].dir / "step_6"), str(tmp_path / name), "--max_shard_size", "100KB")
        assert out.returncode == 0, out.stderr[-2000:]
        assert "verified" in out.stdout
    assert (tmp_path / "tp2" / "model.safetensors.index.json").exists(), "sharded by --max_shard_size"
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "tp2")
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "tp1")
    assert a.model.embed_tokens.weight.shape == (259, 64), "no vocabulary padding in the export"
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close_rel(a(ids).logits, b(ids).logits, "logits of the exported TP=2 and TP=1 runs")


@pytest.mark.parametrize("config,batch", [("tp1", "8"), ("tp4", "8"), ("tp2_dp2", "4")])
def test_resume_tp2_checkpoint_at_another_layout(runs, tmp_path, config, batch):
    """TP 2->1, 2->4 (kv heads then replicated) and DP 1->2: same global batch, same losses."""
    tp2 = runs["tp2"].losses
    resumed = finetune(
        config, tmp_path, "--max_steps", "6", "--batch_size", batch, "--resume", str(runs["tp2"].dir / "step_3")
    )
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert_close_rel(resumed[step], tp2[step], f"loss at step {step} after resuming at {config}")


def test_resume_tp1_checkpoint_at_tp2(runs, tmp_path):
    tp1 = runs["tp1"].losses
    resumed = finetune("tp2", tmp_path, "--max_steps", "6", "--resume", str(runs["tp1"].dir / "step_3"))
    for step in (4, 5, 6):
        assert_close_rel(resumed[step], tp1[step], f"loss at step {step} after TP 1->2")


def test_damaged_checkpoints_are_named_and_nothing_is_written(runs, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(runs["tp2"].dir / "step_6", damaged)
    victim = damaged / "model" / "tp01-pp00.safetensors"
    victim.write_bytes(victim.read_bytes()[:200])
    out = mtk_export(str(damaged), str(tmp_path / "out"))
    assert out.returncode == 2 and f"{victim} has 200 bytes, the checkpoint recorded" in out.stderr
    victim.unlink()
    out = mtk_export(str(damaged), str(tmp_path / "out"))
    assert out.returncode == 2 and f"{victim} is missing" in out.stderr
    assert not list(tmp_path.glob("out*")), "nothing written"
    assert out.stderr.strip().count("\n") == 0


def test_save_pretrained_idiom_keeps_gpt2_layout_and_ties(tmp_path):
    """examples/finetune.py --save_model: unwrap_model(model).save_pretrained(state_dict=get_state_dict(model))."""
    finetune("tp2", tmp_path / "run", "--model", "tiny-gpt2", "--max_steps", "3", "--save_model", str(tmp_path / "hf"))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert saved.transformer.h[0].attn.c_attn.weight.shape == (64, 192), "Conv1D [in, out] layout"
    assert saved.lm_head.weight is saved.transformer.wte.weight, "tied as HF ties"
    out = mtk_export(str(tmp_path / "run" / "step_3"), str(tmp_path / "exported"))
    assert out.returncode == 0, out.stderr[-2000:]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    for (name, a), b in zip(saved.state_dict().items(), exported.state_dict().values()):
        assert torch.equal(a, b), name


def _local_model_with_tokenizer(directory: Path) -> None:
    """A local HF directory as users have them: weights, config and a tokenizer (built offline)."""
    import json as _json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mtk.models import build_model, resolve_config

    words = set()
    for line in (ROOT / "examples" / "data" / "sample.jsonl").read_text().splitlines():
        words.update(_json.loads(line)["text"].replace(".", " .").split())
    vocab = {tok: i for i, tok in enumerate(["[UNK]", "[EOS]", "[PAD]", *sorted(words)])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="[EOS]", pad_token="[PAD]")
    config = resolve_config("tiny-llama")
    config.vocab_size, config.eos_token_id, config.pad_token_id, config.bos_token_id = len(vocab), 1, 2, None
    build_model(config, seed=3).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def test_local_directory_with_tokenizer_through_training_and_export(tmp_path):
    """The directory's tokenizer and generation config (two eos ids, sampling at temperature 0.6) come out of the
    export: the config alone made a model that generated greedily and stopped at one eos."""
    from transformers import GenerationConfig

    _local_model_with_tokenizer(tmp_path / "local")
    generation = GenerationConfig(eos_token_id=[1, 5], do_sample=True, temperature=0.6, pad_token_id=2)
    generation.save_pretrained(tmp_path / "local")
    losses = finetune(
        "tp2", tmp_path / "run", "--model", str(tmp_path / "local"), "--max_steps", "8", "--seq_len", "32"
    )
    assert losses[8] < losses[1]
    assert (tmp_path / "run" / "step_8" / "tokenizer" / "tokenizer.json").exists()
    out = mtk_export(str(tmp_path / "run" / "step_8"), str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr[-2000:]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = tokenizer("the cat walks to the river .", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == tokenizer.vocab_size
    exported = model.generation_config
    assert (exported.eos_token_id, exported.do_sample, exported.temperature) == ([1, 5], True, 0.6)
