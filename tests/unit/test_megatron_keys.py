"""Every megatron_lm key accelerate's launcher exports is acted on, accepted at its off value, or refused."""

import re
from pathlib import Path

import accelerate
import pytest

from mtk.config import RunSettings
from mtk.errors import ConfigError
from mtk.integrations.accelerate import sharding
from mtk.integrations.accelerate.launcher import (
    accelerate_block_keys,
    accelerate_megatron_keys,
    check_launcher_blocks,
    check_launcher_keys,
    config_file_from_argv,
)
from mtk.integrations.accelerate.megatron_keys import MEGATRON_KEYS, check_megatron_environment
from mtk.pipeline.balance import asked_layers


def test_every_variable_accelerate_exports_is_in_the_table():
    source = (Path(accelerate.__file__).parent / "utils" / "launch.py").read_text()
    block = source[source.index('prefix = "MEGATRON_LM_"') :]
    block = block[: block.index('current_env["OMP_NUM_THREADS"]')]  # the Megatron branch only
    exported = set(re.findall(r'prefix \+ "([A-Z_0-9]+)"', block))
    assert len(exported) > 20, "accelerate's launcher changed shape: read utils/launch.py again"
    assert exported <= set(MEGATRON_KEYS), sorted(exported - set(MEGATRON_KEYS))


def _check(**variables) -> list[str]:
    lines: list[str] = []
    check_megatron_environment({f"MEGATRON_LM_{k}": v for k, v in variables.items()}, lines.append)
    return lines


def test_accelerates_defaults_pass_quietly():
    assert (
        _check(TP_DEGREE="2", PP_DEGREE="1", USE_CUSTOM_FSDP="False", GRADIENT_CLIPPING="1.0", NO_SAVE_OPTIM="False")
        == []
    )


@pytest.mark.parametrize(
    "variable,value,message",
    [
        ("NO_LOAD_OPTIM", "True", "megatron_lm_no_load_optim: True is not supported"),
        ("OPTIMIZER_CPU_OFFLOAD", "True", "zero2_offload.json"),
        ("USE_CUSTOM_FSDP", "True", "FSDP2 through accelerate's parallelism_config"),
        ("HIDDEN_DROPOUT", "0.1", "config.json"),
        ("USE_ROTARY_POSITION_EMBEDDINGS", "True", "architecture decides"),
        ("ATTENTION_BACKEND", "triton", "use one of"),
        ("SOMETHING_NEW", "1", "megatron_lm_something_new is a megatron_lm key mtk does not know"),
    ],
)
def test_a_key_mtk_cannot_honour_is_refused_by_name(variable, value, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _check(**{variable: value})


def test_fixed_behaviours_are_reported():
    lines = _check(CALCULATE_PER_TOKEN_LOSS="True", ATTENTION_SOFTMAX_IN_FP32="False")
    assert len(lines) == 2 and all(line.startswith("mtk: megatron_lm_") for line in lines)


def test_a_block_without_tp_or_pp_says_which_layout_runs():
    lines: list[str] = []
    env = {"ACCELERATE_USE_MEGATRON_LM": "true", "MEGATRON_LM_TP_DEGREE": "1", "MEGATRON_LM_PP_DEGREE": "1"}
    check_megatron_environment(env, lines.append)
    assert len(lines) == 1 and "every process is a data-parallel replica" in lines[0]
    for key in ("MEGATRON_LM_CONTEXT_PARALLEL_SIZE", "MEGATRON_LM_EXPERT_MODEL_PARALLEL_SIZE"):  # they split it too
        lines.clear()
        check_megatron_environment({**env, key: "2"}, lines.append)
        assert not any("data-parallel replica" in line for line in lines), (key, lines)


def test_recompute_settings():
    assert RunSettings().recompute is None
    assert RunSettings.from_env({"MEGATRON_LM_RECOMPUTE_ACTIVATIONS": "True"}).recompute == "selective"
    both = {"MEGATRON_LM_RECOMPUTE_ACTIVATIONS": "True", "MEGATRON_LM_RECOMPUTE_GRANULARITY": "full"}
    assert RunSettings.from_env(both).recompute == "full"
    with pytest.raises(ConfigError, match="recompute_method 'every'"):
        RunSettings(recompute_method="every")
    with pytest.raises(ConfigError, match="recompute_granularity 'most'"):
        RunSettings(recompute_granularity="most")
    assert RunSettings(recompute_granularity="full", recompute_method="block", recompute_num_layers=2).recompute
    for off in ({}, {"MEGATRON_LM_RECOMPUTE_GRANULARITY": "selective"}):  # (they were dropped without a word)
        for key, value in (("METHOD", "block"), ("NUM_LAYERS", "2")):
            with pytest.raises(ConfigError, match="choose the blocks of a full recompute, and this run's recompute"):
                RunSettings.from_env({**off, f"MEGATRON_LM_RECOMPUTE_{key}": value})


def test_an_attention_backend_this_machine_cannot_run_is_one_line(monkeypatch):
    import importlib.util

    from mtk.integrations.accelerate.megatron_keys import act_on_model
    from mtk.models import build_model

    model = build_model("tiny-llama", seed=0)
    if importlib.util.find_spec("flash_attn") is not None:  # (a machine that has it: transformers' refusal, as here)

        def refused(implementation: str) -> None:
            raise ImportError("FlashAttention2 has been toggled on, but it cannot be used due to the following error")

        monkeypatch.setattr(model, "set_attn_implementation", refused)
    monkeypatch.setenv("MEGATRON_LM_ATTENTION_BACKEND", "flash")
    said = "megatron_lm_attention_backend: flash (flash_attention_2) cannot run here: FlashAttention2 has been toggled"
    with pytest.raises(ConfigError, match=re.escape(said)):
        act_on_model(model, RunSettings(), print)


def test_last_stage_layers():
    settings = RunSettings.from_env({"MEGATRON_LM_DECODER_LAST_PIPELINE_NUM_LAYERS": "1"})
    assert asked_layers(settings, 4, 2) == (3, 1)
    assert asked_layers(settings, 6, 3) == (3, 2, 1)
    assert asked_layers(settings, 4, 1) == ()
    assert settings.check_pipeline(1) == ["mtk: decoder_last_pipeline_num_layers=1 does nothing at pp = 1"]
    with pytest.raises(ConfigError, match="leaves 0 of the model's 1 layers"):
        asked_layers(settings, 1, 2)
    with pytest.raises(ConfigError, match="give one of them"):
        RunSettings(pipeline_layers=(2, 2), last_stage_layers=1)


def test_every_key_accelerates_launcher_parses_is_in_the_table():
    """A key accelerate parses but never exports would be dropped between the YAML and mtk."""
    parsed = {key.removeprefix("megatron_lm_").upper() for key in accelerate_megatron_keys()}
    assert len(parsed) > 20 and parsed <= set(MEGATRON_KEYS), sorted(parsed - set(MEGATRON_KEYS))


def test_the_launchers_config_file_is_read_from_its_command_line(tmp_path):
    cwd = tmp_path
    argv = ["/usr/bin/python3", "/usr/bin/accelerate", "launch", "--config_file", "cfg/tp2.yaml", "train.py", "--x"]
    assert config_file_from_argv(argv, cwd) == cwd / "cfg/tp2.yaml"
    assert config_file_from_argv(["accelerate", "launch", "--config-file=/abs/a.yaml", "t.py"], cwd) == Path(
        "/abs/a.yaml"
    )
    default = config_file_from_argv(["accelerate", "launch", "t.py", "--config_file", "not-ours.yaml"], cwd)
    assert default is not None and default.name == "default_config.yaml", "the script's own flag is not the launcher's"
    assert config_file_from_argv(["python", "-m", "torch.distributed.run", "t.py"], cwd) is None
    for start in (["python", "-m", "accelerate.commands.launch"], ["/usr/bin/python3", "/usr/bin/accelerate-launch"]):
        assert config_file_from_argv([*start, "--config_file", "a.yaml", "t.py"], cwd) == cwd / "a.yaml", start


def test_a_misspelt_key_in_the_yaml_is_refused_by_name(tmp_path):
    config = tmp_path / "tp2.yaml"
    config.write_text("distributed_type: MEGATRON_LM\nmegatron_lm_config:\n  megatron_lm_tp_degree: 2\n"
                      "  megatron_lm_sequence_paralellism: true\n")  # fmt: skip
    with pytest.raises(
        ConfigError, match="'megatron_lm_sequence_paralellism' is unknown.*megatron_lm_sequence_parallelism"
    ):
        check_launcher_keys(config)
    good = "megatron_lm_config:\n  megatron_lm_tp_degree: 2\n  megatron_lm_sequence_parallelism: true\n"
    config.write_text("distributed_type: MEGATRON_LM\n" + good)
    check_launcher_keys(config)  # every key known: nothing to say
    for kind in ("MULTI_CPU\n", "MULTI_GPU\n", "DEEPSPEED\n", ""):  # accelerate exports it for MEGATRON_LM only
        config.write_text(f"distributed_type: {kind}" + good if kind else good)
        with pytest.raises(ConfigError, match="a megatron_lm_config block with distributed_type .*drop the block"):
            check_launcher_keys(config)
    check_launcher_keys(None)  # no launcher seen (torchrun, another OS): the environment check alone


def test_the_launchers_yaml_is_checked_whatever_its_distributed_type(tmp_path, monkeypatch):
    """A DEEPSPEED YAML with a megatron_lm_config block trained at TP 1 without a word: accelerate exports no
    MEGATRON_LM_* variable for it, so the check of the launcher's YAML must not wait for one."""
    import mtk.integrations.accelerate.megatron_keys as megatron_keys

    config = tmp_path / "ds.yaml"
    config.write_text("distributed_type: DEEPSPEED\nmegatron_lm_config:\n  megatron_lm_tp_degree: 2\n")
    monkeypatch.setattr(megatron_keys, "launcher_config_file", lambda: config)
    with pytest.raises(ConfigError, match='distributed_type DEEPSPEED, which makes accelerate drop the block.*"mtk"'):
        check_megatron_environment({}, [].append)


def test_every_parallelism_config_and_fsdp_key_accelerate_exports_is_known():
    """The known keys are accelerate's own: each PARALLELISM_CONFIG_* / FSDP_* variable its launcher builds comes
    from one of them (fsdp_ignored_modules has no option: only a YAML gives it)."""
    source = (Path(accelerate.__file__).parent / "utils" / "launch.py").read_text()
    for block, prefix in (("parallelism_config", "parallelism_config_"), ("fsdp_config", "fsdp_")):
        known = accelerate_block_keys(block)
        assert known is not None
        exported = set(re.findall(rf"args\.({prefix}\w+)", source))
        assert len(exported) > 8 and exported <= set(known), (block, sorted(exported - set(known)))
    assert "fsdp_ignored_modules" in (accelerate_block_keys("fsdp_config") or [])


@pytest.mark.parametrize(
    "block, line, message",
    [
        ("parallelism_config", "parallelism_config_bogus: 3", "'parallelism_config_bogus' is unknown to accelerate"),
        ("parallelism_config", "parallelism_config_tp_szie: 2", r"did you mean parallelism_config_tp_size\?$"),
        ("parallelism_config", "tp_size: 2", r"'tp_size' is unknown.*did you mean parallelism_config_tp_size\?$"),
        ("fsdp_config", "fsdp_verison: 2", r"'fsdp_verison' is unknown.*did you mean fsdp_version\?$"),
        ("fsdp_config", "reshard_after_fwd: true", r"did you mean fsdp_reshard_after_forward\?$"),
        ("fsdp_config", "fsdp_bogus: 1", "'fsdp_bogus' is unknown to accelerate.*accelerate knows: fsdp_"),
    ],
)
def test_an_unknown_parallelism_or_fsdp_key_in_the_yaml_is_refused_by_name(tmp_path, block, line, message):
    """accelerate copies every key of these blocks onto its arguments and exports only those it knows: a misspelt
    one trained at accelerate's default without a word."""
    config = tmp_path / "fsdp.yaml"
    blocks = {
        "fsdp_config": ["fsdp_version: 2", "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP"],
        "parallelism_config": ["parallelism_config_dp_shard_size: 2", "parallelism_config_tp_size: 2"],
    }
    blocks[block].append(line)
    config.write_text("distributed_type: FSDP\n" + "".join(f"{b}:\n" + "".join(f"  {k}\n" for k in keys)
                                                        for b, keys in blocks.items()))  # fmt: skip
    with pytest.raises(ConfigError, match=f"^{re.escape(str(config))}: {block} key .*{message}") as err:
        check_launcher_blocks(config)
    assert "\n" not in str(err.value)


def test_every_parallelism_and_fsdp_key_accelerate_knows_passes(tmp_path):
    """No false refusal: this repository's YAMLs, every key accelerate knows, fsdp_config keys without their "fsdp_"
    (accelerate adds it), and blocks a non-local compute environment never copies."""
    for yaml_file in sorted(Path(__file__).parents[2].glob("accelerate_configs/*.yaml")):
        check_launcher_blocks(yaml_file)
    config = tmp_path / "all.yaml"
    lines = ["distributed_type: FSDP"]
    for block in ("parallelism_config", "fsdp_config"):
        lines += [f"{block}:"] + [f"  {key}: 1" for key in accelerate_block_keys(block) or []]
    config.write_text("\n".join(lines + ["  version: 2", "  ignored_modules: null", ""]))
    check_launcher_blocks(config)
    config.write_text("compute_environment: AMAZON_SAGEMAKER\nparallelism_config:\n  bogus: 1\n")
    check_launcher_blocks(config)
    check_launcher_blocks(None)


def test_the_accelerators_sharding_reads_the_launchers_yaml(tmp_path, monkeypatch):
    """Wired where accelerate's parallelism_config is taken over (the Accelerator's constructor), whenever the
    launcher exported either block."""
    config = tmp_path / "pc.yaml"
    config.write_text("distributed_type: FSDP\nparallelism_config:\n  parallelism_config_bogus: 3\n")
    monkeypatch.setattr(sharding, "launcher_config_file", lambda: config)
    for flag in ("ACCELERATE_USE_PARALLELISM_CONFIG", "ACCELERATE_USE_FSDP"):
        with pytest.raises(ConfigError, match="parallelism_config key 'parallelism_config_bogus' is unknown"):
            sharding.sharding_from_accelerate(None, None, print, env={flag: "true"})
    assert sharding.sharding_from_accelerate(None, None, print, env={}) == (None, None)  # no block in play
