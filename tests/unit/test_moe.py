"""What mixture-of-experts models cannot do yet is one line (the multi-process checks are in
tests/distributed/test_expert_parallel.py and tests/e2e/test_expert_parallel.py)."""

import pytest

from mtk.errors import UnsupportedModelError
from mtk.models import build_model, builtin_config
from mtk.parallel.context import attach_context_parallel
from mtk.parallel.expert_parallel import spread_experts
from mtk.parallel.router_loss import router_loss_refusal, whole_router_loss


def test_context_and_pipeline_parallelism_take_the_routers_load_balancing_loss_where_they_can_sum_it():
    """CP sums transformers' load_balancing_loss_func over its group and a pipeline carries its sums through the
    stages (tests/distributed/test_expert_parallel.py: exact against one process); a model whose code has no such
    function is one line for each."""
    from torch import nn

    config = builtin_config("tiny-qwen3-moe")
    assert router_loss_refusal(config) is None
    assert router_loss_refusal(config, "pipeline parallelism") is None

    class OwnCodeForCausalLM(nn.Module):  # an MoE model of its own code: its loss cannot be summed over the group
        pass

    own = OwnCodeForCausalLM()
    own.config = config
    for parallelism in ("context parallelism", "pipeline parallelism"):
        with pytest.raises(UnsupportedModelError, match="needs transformers' load_balancing_loss_func") as refused:
            whole_router_loss(own, parallelism)
        assert parallelism in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(UnsupportedModelError, match="needs transformers' load_balancing_loss_func"):
        attach_context_parallel(own, None)
    config.output_router_logits = False
    whole_router_loss(own, "pipeline parallelism")  # no term: nothing to sum
    assert router_loss_refusal(builtin_config("tiny-llama"), "pipeline parallelism") is None


def test_a_pipeline_carries_routing_sums_bit_for_bit_in_the_models_dtype():
    """The ``[2E + 1]`` fp32 sums ride in the hidden states' message (bf16, fp16, fp32; as fp64 in an fp64 one)
    unchanged, and so do their gradients."""
    import torch

    from mtk.pipeline.message import StageMessage

    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        message = StageMessage(hidden_size=6, dtype=dtype, router_experts=5)
        hidden = torch.randn(2, 3, 6, dtype=dtype)
        sums = torch.randn(11, dtype=torch.float32) * 1e3
        packed = message.pack(hidden, sums)
        assert packed.dtype == dtype and packed.numel() == message.numel(2, 3)
        got_hidden, got_sums = message.unpack(packed, 2, 3)
        assert torch.equal(got_hidden, hidden) and torch.equal(got_sums.float(), sums)
        _, nothing = message.unpack(message.pack(hidden, None), 2, 3)  # no gradient reached the sums: zeros
        assert not nothing.any()
    plain = StageMessage(hidden_size=6, dtype=torch.float32)
    assert plain.numel(2, 3) == 36 and plain.unpack(plain.pack(hidden.float(), None), 2, 3)[1] is None


def test_a_pipeline_needs_the_experts_and_top_k_its_sums_count():
    from torch import nn
    from transformers import PretrainedConfig

    from mtk.pipeline.routing import router_shape

    assert router_shape(build_model("tiny-qwen3-moe", seed=0)) == (8, 2)
    unnamed = nn.Module()  # a load-balancing term, but no experts or top-k under a name mtk knows
    unnamed.config = PretrainedConfig(output_router_logits=True, router_aux_loss_coef=0.01)
    with pytest.raises(UnsupportedModelError, match="needs the model's num_experts and num_experts_per_tok"):
        router_shape(unnamed)
    assert router_shape(build_model("tiny-llama", seed=0)) == (0, 0)


def test_expert_parallelism_on_a_dense_model_is_one_line():
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM has no mixture-of-experts layer"):
        spread_experts(build_model("tiny-llama", seed=0), None)


def test_routing_sums_a_pipeline_carried_are_never_dropped_silently():
    """The last stage's load-balancing call must add the sums the earlier stages sent; a call that would fall back
    to transformers' own (no logits tuple, no expert count) is one line, not an unbalanced run."""
    import torch

    from mtk.errors import ConfigError
    from mtk.parallel.router_loss import carrying, load_balancing_loss

    def original(*args):
        return "transformers' own"

    logits = (torch.randn(6, 4),)
    assert load_balancing_loss(original, logits, 4, 2) == "transformers' own"  # nothing carried: untouched
    with carrying(torch.zeros(9)):
        assert torch.is_tensor(load_balancing_loss(original, logits, 4, 2))
        for bad in ((None, 4), (logits, None)):
            with pytest.raises(ConfigError, match="must add the earlier stages' routing sums"):
                load_balancing_loss(original, *bad)
        with pytest.raises(ConfigError, match="carried routing sums of 4 experts to a loss over 3"):
            load_balancing_loss(original, (torch.randn(6, 3),), 3, 2)


def test_expert_factors_take_the_inits_that_need_no_base_tensor():
    import peft
    from peft import LoraConfig

    from mtk.errors import ConfigError
    from mtk.lora.experts import draw_expert_factors

    model = peft.get_peft_model(
        build_model("tiny-qwen3-moe", seed=0),
        LoraConfig(r=2, target_modules=[], target_parameters=["mlp.experts.down_proj"]),
    )
    with pytest.raises(ConfigError, match="init_lora_weights='pissa' needs the whole base tensor"):
        draw_expert_factors(model, "default", "pissa", seed=0)
    assert draw_expert_factors(model, "default", True, seed=0) == 0  # whole factors, nothing cut at one process


def test_experts_stored_transposed_are_cut_along_their_width_even_where_shapes_cannot_tell():
    """A hidden size twice the expert width makes ``[E, H, 2I]`` look like ``[E, 2I, H]``: the cut followed the
    shapes and split the hidden axis of transposed experts. transformers' ``is_transposed`` decides."""
    import torch
    from torch import nn

    from mtk.parallel.experts import _specs

    class Experts(nn.Module):
        is_transposed = True

        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(2, 8, 8))  # [E, H, 2I]: H = 8, I = 4
            self.down_proj = nn.Parameter(torch.zeros(2, 4, 8))  # [E, I, H]

    specs = _specs(Experts(), intermediate=4, tp_size=2, rank=1)
    assert specs["gate_up_proj"][1].dim == 2 and specs["down_proj"][1].dim == 1
    Experts.is_transposed = False  # [E, 2I, H] and [E, H, I]
    specs = _specs(Experts(), intermediate=4, tp_size=2, rank=1)
    assert specs["gate_up_proj"][1].dim == 1 and specs["down_proj"][1].dim == 2
