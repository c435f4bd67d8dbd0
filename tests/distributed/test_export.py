"""An exported checkpoint is the TP model: from_pretrained gives the logits the TP model gave."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from mtk.checkpoint.export import export_checkpoint
from mtk.checkpoint.sharded import save_checkpoint
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
