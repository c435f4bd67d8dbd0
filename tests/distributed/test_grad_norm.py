"""The TP-aware global gradient norm and clipping equal torch's on the unconverted model."""

import copy
import math

import pytest
import torch

from mtk.convert import parallelize
from mtk.models import build_model
from mtk.parallel import ParallelState
from mtk.parallel.gather import iter_full_tensors
from mtk.parallel.grad_norm import clip_grad_norm_tp_, grad_norm_tp
from mtk.testing import assert_close_rel, run_distributed


def _norms(rank: int, world_size: int, name: str) -> None:
    state = ParallelState.build(tp_size=world_size)
    reference = build_model(name).eval()
    model = parallelize(copy.deepcopy(reference), state).eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    reference(input_ids=ids, labels=ids).loss.backward()
    model(input_ids=ids, labels=ids).loss.backward()
    for norm_type in (2.0, math.inf):
        expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()], norm_type)
        assert_close_rel(grad_norm_tp(model.parameters(), state, norm_type), expected, f"norm {norm_type}")
    max_norm = 0.1  # well below the norm: clipping is active
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    assert_close_rel(clip_grad_norm_tp_(list(model.parameters()), max_norm, state), expected, "clip returns the norm")
    ref_grads = dict(reference.named_parameters())
    for param_name, grad in iter_full_tensors(model, state.tp_group, grads=True):
        assert_close_rel(grad, ref_grads[param_name].grad, f"clipped grad of {param_name}", scale_floor=1e-8)


@pytest.mark.parametrize("name,tp", [("tiny-qwen2", 2), ("tiny-llama", 4), ("tiny-gpt2", 2)])
def test_grad_norm_and_clipping_match_torch(name, tp):
    """qwen2: tied embeddings; llama at tp=4: kv heads replicated twice; gpt2: Conv1D + fused qkv."""
    run_distributed(_norms, world_size=tp, args=(name,))
