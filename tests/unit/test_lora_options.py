"""The ``--lora_*`` options become PEFT's LoraConfig; a stray one is one line."""

import argparse

import pytest
import torch

from mtk.errors import ConfigError
from mtk.lora.options import add_lora_arguments, base_dtype, lora_config

pytestmark = pytest.mark.unit


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_lora_arguments(parser)
    return parser.parse_args(argv)


def test_no_rank_no_lora():
    assert lora_config(_parse()) is None


def test_options_reach_lora_config():
    config = lora_config(
        _parse("--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.1", "--lora_targets", "q_proj, v_proj")
    )
    assert (config.r, config.lora_alpha, config.lora_dropout) == (8, 16, 0.1)
    assert set(config.target_modules) == {"q_proj", "v_proj"} and config.task_type == "CAUSAL_LM"
    assert lora_config(_parse("--lora_r", "4")).target_modules == "all-linear"
    experts = lora_config(_parse("--lora_r", "4", "--lora_target_parameters", "mlp.experts.gate_up_proj, x.down_proj"))
    assert experts.target_parameters == ["mlp.experts.gate_up_proj", "x.down_proj"]
    assert experts.target_modules == "all-linear"  # and the linears, unless --lora_targets says otherwise
    with pytest.raises(ConfigError, match="--lora_dropout with --lora_target_parameters: PEFT adapts parameters"):
        lora_config(_parse("--lora_r", "4", "--lora_dropout", "0.1", "--lora_target_parameters", "x.down_proj"))


@pytest.mark.parametrize(
    "argv",
    [
        ("--lora_alpha", "16"),
        ("--base_dtype", "bf16"),
        ("--lora_targets", "q_proj"),
        ("--lora_target_parameters", "a.b"),
    ],
)
def test_a_lora_option_without_a_rank_is_one_line(argv):
    with pytest.raises(ConfigError, match=f"{argv[0]} configure LoRA adapters; add --lora_r R"):
        lora_config(_parse(*argv))


@pytest.mark.parametrize("argv", [("--lora_r", "0"), ("--lora_dropout", "1.5"), ("--base_dtype", "int8")])
def test_bad_values_are_refused_while_parsing(argv):
    with pytest.raises(SystemExit):
        _parse(*argv)


def test_base_dtype():
    assert base_dtype(_parse("--lora_r", "4", "--base_dtype", "bf16")) is torch.bfloat16
    assert base_dtype(_parse("--lora_r", "4")) is torch.float32


def test_a_lora_resume_with_the_base_in_another_dtype_names_it():
    """--base_dtype changed on resume: the base's sums differ too, and the line said "trained on the base 'llama'
    (..., sum 310.312578); this run's base has ... sum 310.320916", as if another model had been given."""
    from peft import LoraConfig

    from mtk.checkpoint.base_model import base_record, check_base
    from mtk.convert import parallelize
    from mtk.errors import CheckpointError
    from mtk.lora import get_peft_model
    from mtk.models import build_model
    from mtk.parallel import ParallelState

    parallel = ParallelState.build()
    config = LoraConfig(r=4, target_modules=["q_proj"])
    model = get_peft_model(parallelize(build_model("tiny-llama", seed=0), parallel), config, report=lambda line: None)
    saved = base_record(model, parallel)
    check_base("step_2", saved, model, parallel)
    for param in model.parameters():
        if not param.requires_grad:
            param.data = param.data.to(torch.bfloat16)
    with pytest.raises(CheckpointError, match=r"in 'torch\.float32'; this run holds it in 'torch\.bfloat16' \(--base"):
        check_base("step_2", saved, model, parallel)
