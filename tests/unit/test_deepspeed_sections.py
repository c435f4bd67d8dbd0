"""A DeepSpeed JSON's top-level keys: one DeepSpeed does not read (it ignores it without a word: a misspelt
``"gradient_cliping"`` trained unclipped) is one line naming it, on both launch paths; every key DeepSpeed reads,
every JSON in ds_configs/, and what accelerate's plugin writes pass."""

import json
import re
from pathlib import Path

import pytest

from mtk.config import ConfigError
from mtk.integrations.deepspeed import deepspeed_config
from mtk.integrations.deepspeed_sections import check_keys, check_sections, deepspeed_keys, removed_deepspeed_keys

pytestmark = pytest.mark.unit

MB = "train_micro_batch_size_per_gpu"
REPO = Path(__file__).parents[2]

# Keys of DeepSpeed's own documentation and of the HF/accelerate DeepSpeed guides' example configs: each must be
# read (or, for a feature DeepSpeed 0.19 removed, refused with DeepSpeed's own message), never called unknown.
DOCUMENTED = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero_optimization",
    "bf16",
    "fp16",
    "optimizer",
    "scheduler",
    "steps_per_print",
    "wall_clock_breakdown",
    "zero_allow_untested_optimizer",
    "communication_data_type",
    "prescale_gradients",
    "gradient_predivide_factor",
    "sparse_gradients",
    "amp",
    "activation_checkpointing",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "aio",
    "checkpoint",
    "data_types",
    "elasticity",
    "autotuning",
    "compression_training",
    "data_efficiency",
    "curriculum_learning",
    "pipeline",
    "dump_state",
    "memory_breakdown",
    "seq_parallel_communication_data_type",
    "zero_force_ds_cpu_optimizer",
    "torch_autocast",
    "tensor_parallel",
    "comms_logger",
    "hybrid_engine",
    "compile",
    "weight_quantization",
    "timers",
    "nebula",
    "sparse_attention",
    "bfloat16",
    "mtk",
)


def test_the_known_keys_come_from_deepspeed_and_cover_its_documented_ones():
    known, removed = deepspeed_keys(), removed_deepspeed_keys()
    assert known is not None and len(known) > 40, "DeepSpeed's config parsing changed shape: read it again"
    missing = [key for key in DOCUMENTED if key not in known and key not in removed]
    assert not missing, missing
    assert {"allgather_size", "sequence_parallel_size", "data_parallel_size", "msamp"} <= known  # (see their sources)
    assert not known & set(removed), sorted(known & set(removed))


@pytest.mark.parametrize(
    "key, message",
    [
        (
            "gradient_cliping",
            '"gradient_cliping" is not a key DeepSpeed reads.*; did you mean "gradient_clipping"\\?$',
        ),
        ("zero_optimisation", 'did you mean "zero_optimization"\\?$'),
        ("train_micro_batch_size", 'did you mean "train_micro_batch_size_per_gpu"\\?$'),
        ("foo_bar", '"foo_bar" is not a key DeepSpeed reads.*remove it \\(DeepSpeed reads: .*gradient_clipping'),
        (
            "tensor_parallel_size",
            '"tensor_parallel_size" is mtk\'s.*' + re.escape('block: "mtk": {"tensor_parallel_size": 2}'),
        ),
    ],
)
def test_a_key_deepspeed_does_not_read_is_one_line_on_both_paths(tmp_path, monkeypatch, key, message):
    """DeepSpeed drops such a key without a word, under the deepspeed launcher (run.py's reading) and through
    accelerate (the file its YAML names): refused first, naming the key and the closest one DeepSpeed reads."""
    from mtk.integrations.accelerate.deepspeed import check_launcher_sections

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({MB: 2, key: {"foo_bar": {}, "tensor_parallel_size": 2}.get(key, 0.001)}))
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: .*{message}") as err:
        deepspeed_config(path, 1)
    assert "\n" not in str(err.value)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    with pytest.raises(ConfigError, match=message):
        check_launcher_sections()


def test_a_removed_feature_is_refused_with_deepspeeds_own_message_in_one_line(tmp_path):
    """DeepSpeed 0.19 refuses these itself, with a DeepSpeedConfigError traceback on every rank."""
    path = tmp_path / "ds.json"
    for key, said in removed_deepspeed_keys().items():
        path.write_text(json.dumps({MB: 2, key: {"enabled": False}}))
        with pytest.raises(ConfigError, match=re.escape(f'"{key}": {said.strip()}')) as err:
            deepspeed_config(path, 1)
        assert "\n" not in str(err.value)


def test_every_key_deepspeed_reads_passes_and_tensor_parallel_keeps_mtks_own_line(tmp_path):
    known = deepspeed_keys()
    assert known is not None
    check_keys(dict.fromkeys(known, "auto"), "ds.json")  # accelerate's "auto" values are not checked here
    check_keys({"_comment": "ZeRO-2 for 8 GPUs", "//": "a JSON comment"}, "ds.json")  # comments, DeepSpeed skips
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({MB: 2, "tensor_parallel": {"autotp_size": 2}}))
    with pytest.raises(ConfigError, match="'tensor_parallel' turns on DeepSpeed's own AutoTP"):
        deepspeed_config(path, 1)


@pytest.mark.parametrize("path", sorted((REPO / "ds_configs").glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_config_passes(path):
    check_sections(json.loads(path.read_text()), path)


def test_what_accelerates_plugin_writes_passes():
    """accelerate's DeepSpeed plugin adds keys to the dict (steps_per_print, the precision sections, the batch
    fields) before DeepSpeed sees it: none of them is one DeepSpeed does not read."""
    from accelerate.utils import DeepSpeedPlugin

    for plugin in (
        DeepSpeedPlugin(hf_ds_config={MB: "auto", "zero_optimization": {"stage": 2}}),
        DeepSpeedPlugin(zero_stage=3, gradient_accumulation_steps=2, gradient_clipping=1.0),
    ):
        plugin.set_mixed_precision("bf16")
        check_keys(plugin.deepspeed_config, "plugin")


def test_activation_checkpointing_that_asks_for_something_is_said_to_do_nothing(tmp_path):
    """DeepSpeed's engine never reads ``activation_checkpointing`` (only a model calling deepspeed.checkpointing
    does; HF models do not): a block with a setting on is one line saying so and what recomputes under mtk; one with
    every setting off (as DeepSpeed's examples ship it) is not."""
    from mtk.integrations.deepspeed import deepspeed_config
    from mtk.integrations.deepspeed_sections import idle_sections

    off = {"partition_activations": False, "cpu_checkpointing": False, "number_checkpoints": None}
    assert idle_sections({"activation_checkpointing": off}, "ds.json") == []
    path = tmp_path / "ds.json"
    config = {"train_micro_batch_size_per_gpu": 2, "activation_checkpointing": {**off, "partition_activations": True}}
    path.write_text(json.dumps(config))
    said: list[str] = []
    deepspeed_config(path, 1, report=said.append)
    assert len(said) == 1 and '"activation_checkpointing" configures deepspeed.checkpointing' in said[0], said
    assert "--gradient_checkpointing" in said[0]
