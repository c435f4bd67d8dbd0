"""Architectures without a rule file: transformers' own tp plan is used when the config ships one, the
generic rules when it does not; either only once they reproduce the model, and every model or TP size
that cannot be converted gets one clear error."""

import pytest
import torch
from transformers import AutoModelForCausalLM, FalconConfig, Olmo2Config, OlmoConfig, StableLmConfig

from mtk.convert import parallelize
from mtk.models import build_model
from mtk.parallel import Layout, ParallelState
from mtk.rules import UnsupportedModelError
from mtk.testing import run_distributed
from tests.distributed.test_architectures import _architecture_checks

SMALL = dict(
    vocab_size=259,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=258,
)


def test_generic_rules_convert_stablelm_exactly():
    """StableLM has no rule file and no tp plan; the generic q/k/v/o + gate/up/down rules pass the parity check."""
    result = run_distributed(_architecture_checks, world_size=2, args=(StableLmConfig(**SMALL),))[0]
    assert result["params"] > 0


def test_olmo2_norms_over_split_heads_are_exact():
    """OLMo2 normalizes q and k over *all* heads: transformers' tp plan gathers q/k/v for that; mtk's rules keep
    the heads split and all-reduces each norm's sum of squares (SplitRMSNorm), exactly."""
    result = run_distributed(_architecture_checks, world_size=2, args=(Olmo2Config(**SMALL),))[0]
    assert result["params"] > 0
    assert result["rules"] == "olmo2"


def _convert_or_error(rank: int, world_size: int, config) -> str:
    state = ParallelState.build(tp_size=world_size)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    try:
        parallelize(model, state)
    except UnsupportedModelError as err:
        return str(err)
    return "converted"


@pytest.mark.parametrize(
    "config,expected",
    [
        # Falcon (no tp plan) fuses query_key_value and names its MLP dense_h_to_4h: no generic rule matches.
        (FalconConfig(**{**SMALL, "num_kv_heads": 2}), "match no module"),
    ],
)
def test_unfit_architectures_get_a_clear_error(config, expected):
    for message in run_distributed(_convert_or_error, world_size=2, args=(config,)):
        assert expected in message
        assert "mtk/rules/" in message and "\n" not in message


def _fake_state(tp: int) -> ParallelState:
    """Size checks happen before any group is used, so no processes are needed to test them."""
    return ParallelState(Layout(world_size=tp, tp_size=tp), rank=0, groups={}, device=torch.device("cpu"))


def test_heads_not_divisible_lists_valid_tp_sizes():
    model = build_model("tiny-llama")  # 4 heads, 2 kv heads, intermediate 128
    with pytest.raises(UnsupportedModelError) as err:
        parallelize(model, _fake_state(3))
    message = str(err.value)
    assert "num_attention_heads = 4 is not divisible by tp = 3" in message
    assert "valid tp sizes for this model: [1, 2, 4]" in message


def test_kv_heads_neither_dividing_nor_multiple():
    config = OlmoConfig(**{**SMALL, "num_attention_heads": 6, "num_key_value_heads": 4, "hidden_size": 48})
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(
        UnsupportedModelError, match="num_key_value_heads = 4 neither divides nor is divided by tp = 3"
    ):
        parallelize(model, _fake_state(3))
