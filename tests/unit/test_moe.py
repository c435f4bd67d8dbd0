"""What mixture-of-experts models cannot do yet is one line (the multi-process checks are in
tests/distributed/test_expert_parallel.py and tests/e2e/test_expert_parallel.py)."""

import pytest
from transformers import AutoModelForCausalLM

from mtk.errors import UnsupportedModelError
from mtk.models import build_model, builtin_config
from mtk.parallel.context import attach_context_parallel, router_loss_refusal
from mtk.parallel.expert_parallel import spread_experts


def test_context_parallelism_refuses_the_routers_load_balancing_loss_and_takes_the_model_without_it():
    config = builtin_config("tiny-qwen3-moe")
    assert "set output_router_logits to false" in router_loss_refusal(config)
    with pytest.raises(UnsupportedModelError, match="load-balancing loss in the loss is not supported yet"):
        attach_context_parallel(AutoModelForCausalLM.from_config(config), None)
    config.output_router_logits = False
    assert router_loss_refusal(config) is None
    assert router_loss_refusal(builtin_config("tiny-llama")) is None


def test_expert_parallelism_on_a_dense_model_is_one_line():
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM has no mixture-of-experts layer"):
        spread_experts(build_model("tiny-llama", seed=0), None)
