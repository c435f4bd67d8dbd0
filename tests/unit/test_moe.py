"""What mixture-of-experts models cannot do yet is one line (the multi-process checks are in
tests/distributed/test_expert_parallel.py and tests/e2e/test_expert_parallel.py)."""

import pytest

from mtk.errors import UnsupportedModelError
from mtk.models import build_model, builtin_config
from mtk.parallel.context import attach_context_parallel, router_loss_refusal
from mtk.parallel.expert_parallel import spread_experts


def test_context_parallelism_takes_the_routers_load_balancing_loss_where_it_can_sum_it_and_a_pipeline_does_not():
    """CP sums transformers' load_balancing_loss_func over its group (tests/distributed/test_expert_parallel.py: exact
    against one process); a model whose code has no such function is one line, and so is a pipeline."""
    from torch import nn

    config = builtin_config("tiny-qwen3-moe")
    assert router_loss_refusal(config) is None
    assert "set output_router_logits to false" in router_loss_refusal(config, "pipeline parallelism")

    class OwnCode(nn.Module):  # an MoE model of its own code: its loss cannot be summed over the group
        pass

    own = OwnCode()
    own.config = config
    with pytest.raises(UnsupportedModelError, match="needs transformers' load_balancing_loss_func"):
        attach_context_parallel(own, None)
    config.output_router_logits = False
    assert router_loss_refusal(config, "pipeline parallelism") is None
    assert router_loss_refusal(builtin_config("tiny-llama"), "pipeline parallelism") is None


def test_expert_parallelism_on_a_dense_model_is_one_line():
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM has no mixture-of-experts layer"):
        spread_experts(build_model("tiny-llama", seed=0), None)
