"""LoRA on the tensor-parallel model equals PEFT's LoRA on the single-process HF model.

Each rank builds the HF model, makes a copy parallel, adds adapters with ``mtk.lora.get_peft_model`` and
gives PEFT's own single-process ``get_peft_model`` the same (gathered) adapters. Loss, logits and every
adapter gradient agree in fp32 (relative error <= 1e-5); the frozen base gets no gradient; the forward
runs exactly the base model's collectives (the adapters ride on them).
"""

import copy

import pytest
import torch
from peft import LoraConfig
from peft import get_peft_model as peft_get_peft_model

from mtk.convert import parallelize
from mtk.lora import get_peft_model
from mtk.models import build_model
from mtk.parallel import ParallelState
from mtk.parallel.gather import full_shape_and_spec, gather_full_tensor, gather_state_dict
from mtk.parallel.trace import count_collectives
from mtk.testing import assert_close_rel, run_distributed
from tests.distributed.test_architectures import ARCHITECTURES, _inputs

# TP=2 for every family; TP=4 where the adapters take another path: B per kv head when kv heads are
# replicated (Llama, Qwen3), per part when the projection is fused (Phi-3, GPT-2); sequence parallelism.
CASES = (
    [(name, 2, False) for name in ARCHITECTURES]
    + [(name, 4, False) for name in ("tiny-llama", "tiny-qwen3", "tiny-phi3", "tiny-gpt2")]
    + [(name, 2, True) for name in ("tiny-llama", "tiny-gpt2", "tiny-phi3")]
)


def _config(targets, **kwargs) -> LoraConfig:
    # init_lora_weights=False: B starts non-zero, so A's gradient is non-zero at the first step too
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **kwargs)


def reference_for(hf_model, peft_model, parallel: ParallelState):
    """PEFT's single-process LoRA model with the parallel model's adapters (gathered, sent to every rank)."""
    full = gather_state_dict(peft_model, parallel)
    shared = [{k: v for k, v in full.items() if "lora_" in k}]
    torch.distributed.broadcast_object_list(shared, src=0)
    reference = peft_get_peft_model(hf_model, copy.deepcopy(peft_model.peft_config["default"]))  # targets resolved
    result = reference.load_state_dict(shared[0], strict=False)
    assert not result.unexpected_keys and not [k for k in result.missing_keys if "lora_" in k]
    return reference


def full_grads(model, parallel: ParallelState) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            shape, spec = full_shape_and_spec(model, name)
            grads[name] = gather_full_tensor(param.grad, spec, shape, parallel.tp_group)
        else:
            assert param.grad is None, f"frozen {name} got a gradient"
    return grads


def _lora_checks(rank: int, world_size: int, name: str, targets, sequence_parallel: bool) -> dict:
    state = ParallelState.build(tp_size=world_size)
    hf = build_model(name, seed=0).eval()  # no dropout: the masks of two layouts differ
    plain = parallelize(copy.deepcopy(hf), state, sequence_parallel=sequence_parallel)
    model = get_peft_model(
        parallelize(copy.deepcopy(hf), state, sequence_parallel=sequence_parallel), _config(targets), report=print
    )
    reference = reference_for(hf, model, state)
    batch = _inputs(name)
    expected = reference(**batch)
    expected.loss.backward()
    with count_collectives() as log:
        plain(**batch)
    base_forward = dict(log.counts())
    with count_collectives() as log:
        out = model(**batch)
    forward = dict(log.counts())
    out.loss.backward()
    if sequence_parallel:
        from mtk.parallel.grads import sync_sequence_parallel_grads

        sync_sequence_parallel_grads(model, state.tp_group)
    assert_close_rel(out.loss, expected.loss, f"{name} loss")
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    assert_close_rel(logits, expected.logits, f"{name} logits")
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    grads = full_grads(model, state)
    assert sorted(grads) == sorted(ref_grads)
    for param_name, grad in grads.items():
        assert_close_rel(grad, ref_grads[param_name], f"{name} grad of {param_name}")
    return {"forward": forward, "base_forward": base_forward, "adapted": len(grads)}


@pytest.mark.parametrize("name,tp,sequence_parallel", CASES)
def test_lora_equals_peft(name, tp, sequence_parallel):
    result = run_distributed(_lora_checks, world_size=tp, args=(name, "all-linear", sequence_parallel))[0]
    assert result["forward"] == result["base_forward"]  # no collective of its own in forward
    assert result["adapted"] > 0
