"""The TP-aware global gradient norm and clipping equal torch's on the unconverted model."""

import copy
import math

import pytest
import torch
import torch.distributed as dist
from deepspeed.runtime.utils import is_model_parallel_parameter

from mtk.convert import parallelize
from mtk.models import build_model
from mtk.parallel import ParallelState
from mtk.parallel.gather import iter_full_tensors
from mtk.parallel.grad_norm import clip_grad_norm_tp_, grad_norm_tp
from mtk.testing import assert_close_rel, run_distributed


def _deepspeed_norm(model: torch.nn.Module, state: ParallelState) -> torch.Tensor:
    """The 2-norm by ZeRO's rule (stage 1/2's and 3's ``get_grad_norm_direct``, its clipping's): a gradient marked
    ``tensor_model_parallel`` is added on every rank, any other on TP rank 0 only; summed over the mp group."""
    tp_rank = state.get_tensor_model_parallel_rank()
    grads = [p.grad for p in model.parameters() if is_model_parallel_parameter(p) or tp_rank == 0]
    total = torch.stack([grad.norm() ** 2 for grad in grads]).sum()
    dist.all_reduce(total, group=state.get_model_parallel_group())
    return total.sqrt()


def _norms(rank: int, world_size: int, name: str, dtype: torch.dtype) -> None:
    state = ParallelState.build(tp_size=world_size)
    reference = build_model(name).to(dtype).eval()
    model = parallelize(copy.deepcopy(reference), state).eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    reference(input_ids=ids, labels=ids).loss.backward()
    model(input_ids=ids, labels=ids).loss.backward()
    for norm_type in (2.0, math.inf):
        expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()], norm_type)
        norm = grad_norm_tp(model.parameters(), state, norm_type)
        assert norm.dtype == dtype  # (fp64 gradients: summed in fp64, as torch sums them)
        assert_close_rel(norm, expected, f"norm {norm_type}")
    whole = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    assert_close_rel(_deepspeed_norm(model, state), whole, "DeepSpeed's norm of mtk's marks")
    max_norm = 0.1  # well below the norm: clipping is active
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    assert_close_rel(clip_grad_norm_tp_(list(model.parameters()), max_norm, state), expected, "clip returns the norm")
    ref_grads = dict(reference.named_parameters())
    for param_name, grad in iter_full_tensors(model, state.tp_group, grads=True):
        assert_close_rel(grad, ref_grads[param_name].grad, f"clipped grad of {param_name}", scale_floor=1e-8)


@pytest.mark.parametrize(
    "name,tp,dtype",
    [
        ("tiny-qwen2", 2, torch.float32),
        ("tiny-llama", 4, torch.float32),
        ("tiny-gpt2", 2, torch.float32),
        ("tiny-gpt2", 2, torch.float64),
    ],
)
def test_grad_norm_and_clipping_match_torch(name, tp, dtype):
    """qwen2: tied embeddings; llama at tp=4: kv heads replicated twice; gpt2: Conv1D + fused qkv, and in fp64."""
    run_distributed(_norms, world_size=tp, args=(name, dtype))
