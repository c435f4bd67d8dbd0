"""Settings: explicit values beat the launcher's environment, overrides are reported, bad values are one line."""

import logging

import pytest

from mtk.config import ConfigError, ParallelConfig, RunSettings


def test_reads_the_variables_accelerate_exports():
    env = {
        "MEGATRON_LM_TP_DEGREE": "2",
        "MEGATRON_LM_PP_DEGREE": "4",
        "MEGATRON_LM_NUM_MICRO_BATCHES": "8",
        "MEGATRON_LM_SEQUENCE_PARALLELISM": "true",
        "MEGATRON_LM_GRADIENT_CLIPPING": "1.0",
        "MEGATRON_LM_EOD_MASK_LOSS": "True",  # what mtk's data does anyway
    }
    assert ParallelConfig.from_env(env) == ParallelConfig(tp_size=2, pp_size=4)
    assert RunSettings.from_env(env) == RunSettings(
        num_micro_batches=8, sequence_parallel=True, gradient_clipping=1.0, eod_mask_loss=True
    )


def test_pipeline_schedule_and_layers_come_from_mtk_variables():
    env = {"MEGATRON_LM_PP_DEGREE": "2", "MTK_PIPELINE_SCHEDULE": "AFAB", "MTK_PIPELINE_LAYERS": "3,1"}
    settings = RunSettings.from_env(env)
    assert (settings.pipeline_schedule, settings.pipeline_layers) == ("afab", (3, 1))
    env = {"MTK_PIPELINE_SCHEDULE": "interleaved", "MTK_VIRTUAL_STAGES": "2", "MEGATRON_LM_NUM_MICRO_BATCHES": "4"}
    settings = RunSettings.from_env(env)
    assert (settings.pipeline_schedule, settings.virtual_stages) == ("interleaved", 2)
    assert settings.check_pipeline(2) == []


def test_the_loss_chunk_comes_from_mtk_variable_unset_is_sized_zero_is_off():
    assert RunSettings.from_env({}).loss_chunk_tokens is None
    assert RunSettings.from_env({"MTK_LOSS_CHUNK_TOKENS": "0"}).loss_chunk_tokens == 0
    assert RunSettings.from_env({"MTK_LOSS_CHUNK_TOKENS": "2048"}).loss_chunk_tokens == 2048


def test_context_parallelism_comes_from_accelerates_megatron_key_and_its_attention_from_mtk_variable():
    assert ParallelConfig.from_env({"MEGATRON_LM_CONTEXT_PARALLEL_SIZE": "4"}).cp_size == 4
    assert ParallelConfig.from_env({}).cp_size == 1
    assert RunSettings.from_env({}).cp_comm_type == "p2p"
    assert RunSettings.from_env({"MTK_CP_COMM_TYPE": "a2a"}).cp_comm_type == "a2a"
    with pytest.raises(ConfigError, match="cp_comm_type 'allgather' is unknown; use one of \\('p2p', 'a2a'\\)"):
        RunSettings.from_env({"MTK_CP_COMM_TYPE": "allgather"})
    with pytest.raises(ConfigError, match="cp_size must be a positive integer, got 0"):
        ParallelConfig.from_env({"MEGATRON_LM_CONTEXT_PARALLEL_SIZE": "0"})


def test_expert_parallelism_comes_from_accelerates_megatron_key():
    assert ParallelConfig.from_env({"MEGATRON_LM_EXPERT_MODEL_PARALLEL_SIZE": "2"}).ep_size == 2
    assert ParallelConfig.from_env({}).ep_size == 1
    assert ParallelConfig.from_env({"MEGATRON_LM_EXPERT_MODEL_PARALLEL_SIZE": "4"}, ep_size=2).ep_size == 2


def test_the_experts_tp_size_comes_from_accelerates_megatron_key_and_is_the_tp_size_or_one():
    """``megatron_lm_expert_tensor_parallel_size``: unset (accelerate exports ``None``) or the TP size splits each
    expert over TP; 1 keeps it whole; anything else is one line, before a process group exists. A checkpoint's
    topology records 1 (older readers know no ``etp``) and reads back the default as the TP size."""
    from mtk.checkpoint.meta import _layout_from_record, _layout_record
    from mtk.errors import LayoutError
    from mtk.parallel.layout import Layout

    env = {"MEGATRON_LM_TP_DEGREE": "2"}
    assert ParallelConfig.from_env({**env, "MEGATRON_LM_EXPERT_TENSOR_PARALLEL_SIZE": "None"}).expert_tp_size == 2
    assert ParallelConfig.from_env({**env, "MEGATRON_LM_EXPERT_TENSOR_PARALLEL_SIZE": "1"}).expert_tp_size == 1
    assert ParallelConfig.from_env(env).etp_size is None
    with pytest.raises(ConfigError, match=r"megatron_lm_expert_tensor_parallel_size\) 3: .* set it to 2 or 1"):
        ParallelConfig.from_env({**env, "MEGATRON_LM_EXPERT_TENSOR_PARALLEL_SIZE": "3"})
    with pytest.raises(ConfigError, match=r"\) 2: .* at tp 1 it can only be 1: set it to 1, or unset it"):
        ParallelConfig.from_env({"MEGATRON_LM_EXPERT_TENSOR_PARALLEL_SIZE": "2"})
    with pytest.raises(LayoutError, match="neither the TP size"):
        Layout(world_size=4, tp_size=4, etp_size=2)
    whole = Layout(world_size=4, tp_size=2, ep_size=2, etp_size=1)
    assert _layout_record(whole)["etp"] == 1 and _layout_from_record(_layout_record(whole)) == whole
    split = Layout(world_size=4, tp_size=2)
    assert "etp" not in _layout_record(split) and _layout_from_record(_layout_record(split)).etp_size == 2


def test_pipeline_settings_are_checked_against_the_layout():
    interleaved = RunSettings(pipeline_schedule="interleaved", virtual_stages=2, num_micro_batches=3)
    with pytest.raises(ConfigError, match="3 micro-batches is not a multiple; use a multiple of 2"):
        interleaved.check_pipeline(2)
    assert interleaved.check_pipeline(1) == [
        "mtk: pipeline_schedule=interleaved does nothing at pp = 1",
        "mtk: virtual_stages=2 does nothing at pp = 1",
        "mtk: num_micro_batches=3 does nothing at pp = 1 (gradient accumulation is gradient_accumulation_steps, or "
        "--grad_accum)",
    ]
    assert RunSettings(pipeline_layers=(3, 1)).check_pipeline(1) == ["mtk: pipeline_layers=3,1 does nothing at pp = 1"]
    assert RunSettings(cp_comm_type="a2a").check_context(1) == ["mtk: cp_comm_type=a2a does nothing at cp = 1"]
    assert RunSettings(cp_comm_type="a2a").check_context(2) == RunSettings().check_context(1) == []


def test_defaults_without_variables():
    assert ParallelConfig.from_env({}) == ParallelConfig()
    assert RunSettings.from_env({}) == RunSettings()


def test_explicit_beats_environment_and_says_so(caplog):
    env = {"MEGATRON_LM_TP_DEGREE": "4", "MTK_PIPELINE_SCHEDULE": "afab"}
    with caplog.at_level(logging.WARNING, logger="mtk"):
        assert ParallelConfig.from_env(env, tp_size=2, pp_size=None).tp_size == 2
        assert RunSettings.from_env(env, pipeline_schedule="1f1b").pipeline_schedule == "1f1b"
        assert ParallelConfig.from_env(env, tp_size=4).tp_size == 4  # same value: nothing to report
    assert caplog.messages == [
        "mtk: tp_size=2 (explicit) overrides MEGATRON_LM_TP_DEGREE=4",
        "mtk: pipeline_schedule=1f1b (explicit) overrides MTK_PIPELINE_SCHEDULE=afab",
    ]


@pytest.mark.parametrize(
    "env,message",
    [
        ({"MEGATRON_LM_TP_DEGREE": "two"}, "MEGATRON_LM_TP_DEGREE='two' is not an integer"),
        ({"MEGATRON_LM_TP_DEGREE": "0"}, "tp_size must be a positive integer"),
        ({"MEGATRON_LM_SEQUENCE_PARALLELISM": "maybe"}, "is not a boolean"),
        ({"MEGATRON_LM_GRADIENT_CLIPPING": "-1"}, "gradient_clipping must be a finite number >= 0"),
        ({"MEGATRON_LM_GRADIENT_CLIPPING": ".nan"}, "MEGATRON_LM_GRADIENT_CLIPPING='.nan' is not a finite number"),
        ({"MEGATRON_LM_GRADIENT_CLIPPING": "inf"}, "MEGATRON_LM_GRADIENT_CLIPPING='inf' is not a finite number"),
        ({"MTK_PIPELINE_SCHEDULE": "gpipe"}, "pipeline schedule 'gpipe' is unknown; use one of"),
        ({"MTK_PIPELINE_LAYERS": "3;1"}, "MTK_PIPELINE_LAYERS='3;1' is not a comma-separated list of integers"),
        ({"MTK_PIPELINE_LAYERS": "4,0"}, "must give every stage at least one layer"),
        ({"MTK_VIRTUAL_STAGES": "2"}, "virtual_stages = 2 needs the interleaved schedule"),
        ({"MTK_PIPELINE_SCHEDULE": "interleaved"}, "the interleaved schedule needs virtual_stages >= 2"),
        ({"MTK_PIPELINE_SCHEDULE": "interleaved", "MTK_VIRTUAL_STAGES": "0"}, "virtual_stages must be a positive"),
        (
            {
                "MTK_PIPELINE_SCHEDULE": "interleaved",
                "MTK_VIRTUAL_STAGES": "2",
                "MEGATRON_LM_DECODER_LAST_PIPELINE_NUM_LAYERS": "1",
            },
            "decoder_last_pipeline_num_layers with virtual stages",
        ),
        ({"MEGATRON_LM_NUM_MICRO_BATCHES": "0"}, "num_micro_batches must be a positive integer"),
        ({"MEGATRON_LM_EOD_MASK_LOSS": "sometimes"}, "is not a boolean"),
        ({"MTK_LOSS_CHUNK_TOKENS": "-1"}, "loss_chunk_tokens must be 0 \\(off\\) or a number of tokens"),
        ({"MTK_LOSS_CHUNK_TOKENS": "auto"}, "MTK_LOSS_CHUNK_TOKENS='auto' is not an integer"),
    ],
)
def test_bad_values(env, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig.from_env(env)
        RunSettings.from_env(env)


def test_unknown_explicit_setting_is_refused():
    with pytest.raises(ConfigError, match="unknown settings \\['pipeline_scheduel'\\]"):
        RunSettings.from_env({}, pipeline_scheduel="afab")
