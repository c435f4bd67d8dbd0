"""An architecture mtk has no rule file for, trained as users type it: a local Gemma 2 directory (tiny, random),
converted by the plan transformers ships with it (``base_model_tp_plan`` / ``base_model_pp_plan``).

``finetune.py --model DIR`` at TP=2 x PP=2 logs the TP=1 losses, a TP=1 checkpoint resumes at TP=2 exactly,
and ``mtk export`` of the TP=2 x PP=2 checkpoint reloads with ``from_pretrained`` (verified tensor by tensor).
"""

from __future__ import annotations

import sys

import pytest

from tests.e2e.launch import ROOT, assert_same_losses, finetune, run_command


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    from mtk.models import VOCAB
    from mtk.verify.sweep import tiny_config

    config = tiny_config("gemma2")
    config.vocab_size = VOCAB  # the byte tokenizer's (the directory ships no tokenizer)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gemma2") / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


ARGS = ("--seq_len", "64", "--max_steps", "4", "--save_every", "2", "--tokenizer", "bytes")  # the dir has no tokenizer


def test_gemma2_trains_exactly_at_every_layout(tmp_path, gemma2_dir):
    reference = finetune("tp1", tmp_path / "tp1", "--model", str(gemma2_dir), *ARGS)
    assert reference[4] < reference[1]
    pipelined = finetune("tp2_pp2", tmp_path / "tp2_pp2", "--model", str(gemma2_dir), *ARGS)
    assert_same_losses(pipelined, reference, range(1, 5), "Gemma 2 TP=2 x PP=2")
    resumed = finetune(
        "tp2", tmp_path / "resumed", "--model", str(gemma2_dir), *ARGS, "--resume", str(tmp_path / "tp1" / "step_2")
    )
    assert_same_losses(resumed, reference, range(3, 5), "Gemma 2 TP=1 checkpoint resumed at TP=2")
    out = run_command(
        [sys.executable, "-m", "mtk.cli.main", "export", str(tmp_path / "tp2_pp2" / "step_4"), str(tmp_path / "hf")],
        cwd=ROOT,
        timeout=600,
    )
    assert out.returncode == 0 and "verified" in out.stdout, out.stderr[-2000:]
