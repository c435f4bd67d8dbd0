"""What mtk's trainers do with each TrainingArguments field they cannot honour as-is (no processes needed)."""

import pytest
from transformers import TrainingArguments

import mtk.trainers
from mtk.config import RunSettings
from mtk.errors import ConfigError
from mtk.trainers.arguments import check_training_arguments, clipping_report, recompute_settings


def _args(tmp_path, **fields) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **fields)


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"torch_compile": True}, "TrainingArguments.torch_compile=True"),
        ({"neftune_noise_alpha": 5.0}, "TrainingArguments.neftune_noise_alpha"),
        ({"save_only_model": True}, "TrainingArguments.save_only_model=True"),
        ({"save_on_each_node": True}, "TrainingArguments.save_on_each_node=True"),
        ({"label_smoothing_factor": 0.1}, "TrainingArguments.label_smoothing_factor"),
        ({"enable_jit_checkpoint": True}, "TrainingArguments.enable_jit_checkpoint=True"),
    ],
)
def test_a_field_mtk_cannot_honour_is_refused_naming_it(tmp_path, fields, named):
    with pytest.raises(ConfigError, match="^" + named.replace(".", r"\.")):
        check_training_arguments(_args(tmp_path, **fields))


def test_fields_mtk_honours_pass(tmp_path):
    check_training_arguments(_args(tmp_path, max_grad_norm=0.5, gradient_accumulation_steps=4, weight_decay=0.1))


def test_gradient_checkpointing_runs_as_mtks_recompute_and_the_launchers_wins(tmp_path):
    args = _args(tmp_path, gradient_checkpointing=True)
    settings, line = recompute_settings(args, RunSettings())
    assert settings.recompute_granularity == "full" and settings.recompute_method == "uniform"
    assert not args.gradient_checkpointing and "mtk's full recompute" in line
    args = _args(tmp_path, gradient_checkpointing=True)
    launcher = RunSettings(recompute_activations=True, recompute_granularity="selective")
    settings, line = recompute_settings(args, launcher)
    assert settings == launcher and "replaced by the accelerate config's recompute" in line
    assert recompute_settings(_args(tmp_path), RunSettings()) == (RunSettings(), None)


def test_a_different_launcher_clipping_is_reported_as_unused(tmp_path):
    assert clipping_report(_args(tmp_path, max_grad_norm=1.0), RunSettings(gradient_clipping=1.0)) is None
    line = clipping_report(_args(tmp_path, max_grad_norm=0.5), RunSettings(gradient_clipping=1.0))
    assert "max_grad_norm=0.5" in line and "megatron_lm_gradient_clipping=1.0 is not used" in line


@pytest.mark.parametrize("name", sorted(mtk.trainers.NOT_PROVIDED))
def test_trls_other_trainers_are_refused_naming_why(name):
    with pytest.raises(ConfigError, match=f"mtk.trainers.{name} is not provided: "):
        getattr(mtk.trainers, name)
