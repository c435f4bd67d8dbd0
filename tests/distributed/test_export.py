"""An exported checkpoint is the TP model: from_pretrained gives the logits the TP model gave, and every tensor
``save_pretrained`` writes (persistent buffers too)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from mtk.checkpoint.export import export_checkpoint
from mtk.checkpoint.hf_load import load_pretrained_tp
from mtk.checkpoint.sharded import load_checkpoint, save_checkpoint
from mtk.convert import parallelize
from mtk.models import build_model
from mtk.parallel import ParallelState
from mtk.testing import assert_close_rel, run_distributed

IDS = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))


def _save_tp_model(rank: int, world_size: int, name: str, directory: str) -> torch.Tensor:
    state = ParallelState.build(tp_size=world_size)
    model = parallelize(build_model(name, seed=7), state).eval()
    with torch.no_grad():
        for param in model.parameters():  # move away from the seeded init: nothing can be re-derived
            param.add_(0.01 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
        logits = model(IDS).logits
    save_checkpoint(directory, state, model, [], [], step=0)
    return logits


@pytest.mark.parametrize("name,tp", [("tiny-qwen2", 2), ("tiny-gpt2", 2), ("tiny-llama", 4)])
def test_export_reloads_with_the_tp_models_logits(tmp_path, name, tp):
    logits = run_distributed(_save_tp_model, world_size=tp, args=(name, str(tmp_path / "ckpt")))[0]
    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert_close_rel(model(IDS).logits, logits, f"{name}: exported logits vs the TP={tp} model's")


def _save_loaded(rank: int, world_size: int, directory: str, checkpoint: str) -> torch.Tensor:
    state = ParallelState.build(tp_size=world_size)
    model = load_pretrained_tp(directory, state).eval()
    with torch.no_grad():
        logits = model(IDS).logits
    save_checkpoint(checkpoint, state, model, [], [], step=0)
    return logits


def _resumed_buffers(rank: int, world_size: int, blank: str, checkpoint: str) -> dict[str, torch.Tensor]:
    state = ParallelState.build(tp_size=1, pp_size=world_size)  # another layout: the checkpoint is resharded
    model = load_pretrained_tp(blank, state)  # the buffers as the class initialises them
    load_checkpoint(checkpoint, state, model, [], [])
    return {name: buffer.clone() for name, buffer in model.named_buffers() if "e_score_correction_bias" in name}


def test_persistent_buffers_are_saved_resumed_at_another_layout_and_exported(tmp_path):
    """GLM-4-MoE's router holds a trained ``e_score_correction_bias`` as a persistent buffer. Checkpoints held
    parameters only: the export had no bias, and ``from_pretrained`` filled it with zeros (other experts chosen,
    logits 8e-3 off) while the export called itself verified."""
    from mtk.verify.sweep import tiny_config

    config = tiny_config("glm4_moe")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "blank")  # zero biases
    trained = AutoModelForCausalLM.from_config(config)
    for name, buffer in trained.named_buffers():
        if "e_score_correction_bias" in name:
            buffer.copy_(torch.randn_like(buffer))
    trained.save_pretrained(tmp_path / "trained")
    checkpoint = str(tmp_path / "ckpt")
    logits = run_distributed(_save_loaded, world_size=2, args=(str(tmp_path / "trained"), checkpoint))[0]
    export_checkpoint(checkpoint, tmp_path / "hf", progress=False)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "trained").eval()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    expected, written = reference.state_dict(), exported.state_dict()
    assert sorted(written) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name
    with torch.no_grad():
        assert_close_rel(exported(IDS).logits, logits, "exported logits vs the TP=2 model's")
    resumed = run_distributed(_resumed_buffers, world_size=2, args=(str(tmp_path / "blank"), checkpoint))
    biases = {name: buffer for stage in resumed for name, buffer in stage.items()}
    assert biases and sorted(biases) == sorted(n for n in expected if "e_score_correction_bias" in n)
    for name, buffer in biases.items():
        assert torch.equal(buffer, expected[name]), f"{name} after a resume at PP 2"
