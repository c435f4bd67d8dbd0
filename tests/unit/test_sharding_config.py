"""accelerate's ``parallelism_config`` and ``fsdp_config`` keys, as ``accelerate launch`` exports them: each is acted
on (TP size, FSDP2/HSDP sizes, reshard_after_forward, the unit classes) or refused in one line naming it, and what
mtk does differently is reported. The training itself is tests/distributed/test_fsdp.py and
tests/e2e/test_memory_features.py."""

import pytest
from accelerate.parallelism_config import ParallelismConfig

from mtk.config import ParallelConfig
from mtk.errors import ConfigError
from mtk.integrations.accelerate.sharding import sharding_from_accelerate
from mtk.models import build_model
from mtk.parallel.fsdp import ShardingSettings, sharded_modules

LAUNCHED = {  # what `accelerate launch` exports for accelerate_configs/tp2_fsdp2.yaml
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_OFFLOAD_PARAMS": "false",
    "FSDP_MIN_NUM_PARAMS": "100000000",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
    "FSDP_FORWARD_PREFETCH": "false",
    "FSDP_USE_ORIG_PARAMS": "true",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
    "FSDP_SYNC_MODULE_STATES": "false",
    "FSDP_ACTIVATION_CHECKPOINTING": "false",
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "false",
}


def _read(pc=None, explicit=None, **env):
    lines: list[str] = []
    config, sharding = sharding_from_accelerate(pc, explicit, lines.append, {**LAUNCHED, **env})
    return config, sharding, lines


def test_the_launched_yaml_is_tp_and_fsdp2():
    config, sharding, lines = _read(ParallelismConfig(tp_size=2, dp_shard_size=2))
    assert config == ParallelConfig(tp_size=2, pp_size=1)
    assert sharding == ShardingSettings(dp_shard_size=2, dp_replicate_size=1, reshard_after_forward=True)
    assert lines == ["mtk: FSDP2 over data parallelism (parallelism_config dp_shard_size 2 x dp_replicate_size 1): "
                     "each TP shard split over 2 ranks"]  # fmt: skip


def test_the_launchers_parallelism_variables_are_read(monkeypatch):
    for key, value in {"TP_SIZE": "2", "DP_SHARD_SIZE": "2", "DP_REPLICATE_SIZE": "2"}.items():
        monkeypatch.setenv(f"PARALLELISM_CONFIG_{key}", value)
    config, sharding, _ = _read(ACCELERATE_USE_PARALLELISM_CONFIG="true")
    assert config.tp_size == 2 and sharding.dp_shard_size == 2 and sharding.dp_replicate_size == 2


def test_acted_on_keys():
    _, sharding, lines = _read(
        ParallelismConfig(dp_shard_size=2),
        FSDP_RESHARD_AFTER_FORWARD="false",
        FSDP_TRANSFORMER_CLS_TO_WRAP="LlamaDecoderLayer, LlamaRMSNorm",
        FSDP_STATE_DICT_TYPE="FULL_STATE_DICT",
        FSDP_BACKWARD_PREFETCH="BACKWARD_PRE",
        FSDP_SYNC_MODULE_STATES="true",
    )
    assert not sharding.reshard_after_forward
    assert sharding.unit_classes == ("LlamaDecoderLayer", "LlamaRMSNorm")
    said = "\n".join(lines)
    assert "fsdp_state_dict_type FULL_STATE_DICT: save_state writes mtk's sharded" in said
    assert "fsdp_backward_prefetch is FSDP1's" in said and "fsdp_sync_module_states" in said


@pytest.mark.parametrize(
    "env, message",
    [
        ({"FSDP_VERSION": "1"}, "fsdp_version 1: mtk shards its TP model with FSDP2"),
        ({"FSDP_OFFLOAD_PARAMS": "true"}, "fsdp_offload_params"),
        ({"FSDP_ACTIVATION_CHECKPOINTING": "true"}, "fsdp_activation_checkpointing: mtk recomputes"),
        ({"FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true"}, "fsdp_activation_checkpointing_offload"),
        ({"FSDP_FORWARD_PREFETCH": "true"}, "fsdp_forward_prefetch is FSDP1's"),
        ({"FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP"}, "fsdp_sharding_strategy SHARD_GRAD_OP is FSDP1's"),
        ({"FSDP_IGNORED_MODULES": "lm_head"}, "fsdp_ignored_modules"),
        ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"}, "fsdp_auto_wrap_policy SIZE_BASED_WRAP"),
        ({"FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}, "leave every rank but 0 uninitialised"),
        ({"FSDP_RESHARD_AFTER_FORWARD": "FULL_SHARD"}, "FSDP_RESHARD_AFTER_FORWARD='FULL_SHARD' is not a boolean"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None,
)
def test_refused_fsdp_keys(env, message):
    with pytest.raises(ConfigError, match=message):
        _read(ParallelismConfig(tp_size=2, dp_shard_size=2), **env)


def test_refused_layouts():
    with pytest.raises(ConfigError, match="sp_size 2 is DeepSpeed's Ulysses"):
        _read(ParallelismConfig(dp_shard_size=2, sp_size=2))
    with pytest.raises(ConfigError, match="tp_size 2 and parallel_config tp_size 4 differ"):
        _read(ParallelismConfig(tp_size=2, dp_shard_size=2), ParallelConfig(tp_size=4))
    with pytest.raises(ConfigError, match="dp_shard_size 1: nothing to shard over"):
        _read(ParallelismConfig(tp_size=2))
    with pytest.raises(ConfigError, match="distributed_type FSDP without a parallelism_config block"):
        _read()
    with pytest.raises(ConfigError, match="must be the data-parallel size 2"):
        ShardingSettings(dp_shard_size=4).check(2)


def test_without_fsdp_the_config_is_tp_and_plain_data_parallelism():
    assert sharding_from_accelerate(None, None, print, {}) == (None, None)
    config, sharding = sharding_from_accelerate(ParallelismConfig(tp_size=2), None, print, {})
    assert config.tp_size == 2 and sharding is None


def test_parallelism_config_cp_size_is_mtks_context_parallelism():
    lines: list[str] = []
    config, sharding = sharding_from_accelerate(ParallelismConfig(tp_size=2, cp_size=2), None, lines.append, {})
    assert config == ParallelConfig(tp_size=2, cp_size=2) and sharding is None
    assert lines[0].startswith("mtk: parallelism_config cp_size 2: mtk's context parallelism")
    assert "cp_backend and cp_comm_strategy do not apply" in lines[0]
    config, _ = sharding_from_accelerate(ParallelismConfig(cp_size=2), None, print, {})
    assert config == ParallelConfig(cp_size=2)
    with pytest.raises(ConfigError, match="cp_comm_strategy alltoall: mtk chooses its context-parallel attention"):
        sharding_from_accelerate(
            ParallelismConfig(cp_size=2), None, print, {"PARALLELISM_CONFIG_CP_COMM_STRATEGY": "alltoall"}
        )
    with pytest.raises(ConfigError, match="cp_size 2 and megatron_lm_context_parallel_size 4 differ"):
        sharding_from_accelerate(ParallelismConfig(cp_size=2), None, print, {"MEGATRON_LM_CONTEXT_PARALLEL_SIZE": "4"})


def test_accelerates_own_fsdp_plugin_is_refused_before_anything_is_built():
    from accelerate.utils import FullyShardedDataParallelPlugin

    from mtk import Accelerator

    with pytest.raises(ConfigError, match="fsdp_plugin would wrap the whole model over every process"):
        Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())


def test_units_are_the_decoder_layers_or_the_named_classes():
    model = build_model("tiny-llama")
    assert [type(m).__name__ for m in sharded_modules(model)] == ["LlamaDecoderLayer"] * 2
    with pytest.raises(ConfigError, match=r"fsdp_transformer_layer_cls_to_wrap names \['Block'\]"):
        sharded_modules(model, ("Block",))
