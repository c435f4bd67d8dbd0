import pytest

from mtk.config import ConfigError, ParallelConfig


def test_reads_the_variables_accelerate_exports():
    env = {
        "MEGATRON_LM_TP_DEGREE": "2",
        "MEGATRON_LM_PP_DEGREE": "4",
        "MEGATRON_LM_NUM_MICRO_BATCHES": "8",
        "MEGATRON_LM_SEQUENCE_PARALLELISM": "true",
        "MEGATRON_LM_GRADIENT_CLIPPING": "1.0",
    }
    assert ParallelConfig.from_env(env) == ParallelConfig(
        tp_size=2, pp_size=4, num_micro_batches=8, sequence_parallel=True, gradient_clipping=1.0
    )


def test_pipeline_schedule_and_layers_come_from_mtk_variables():
    env = {"MEGATRON_LM_PP_DEGREE": "2", "MTK_PIPELINE_SCHEDULE": "AFAB", "MTK_PIPELINE_LAYERS": "3,1"}
    config = ParallelConfig.from_env(env)
    assert (config.pipeline_schedule, config.pipeline_layers) == ("afab", (3, 1))


def test_defaults_without_variables():
    assert ParallelConfig.from_env({}) == ParallelConfig()


@pytest.mark.parametrize(
    "env,message",
    [
        ({"MEGATRON_LM_TP_DEGREE": "two"}, "MEGATRON_LM_TP_DEGREE='two' is not an integer"),
        ({"MEGATRON_LM_TP_DEGREE": "0"}, "tp_size must be a positive integer"),
        ({"MEGATRON_LM_SEQUENCE_PARALLELISM": "maybe"}, "is not a boolean"),
        ({"MEGATRON_LM_GRADIENT_CLIPPING": "-1"}, "gradient_clipping must be >= 0"),
        ({"MTK_PIPELINE_SCHEDULE": "gpipe"}, "pipeline schedule 'gpipe' is unknown; use one of"),
        ({"MTK_PIPELINE_LAYERS": "3;1"}, "MTK_PIPELINE_LAYERS='3;1' is not a comma-separated list of integers"),
        ({"MEGATRON_LM_PP_DEGREE": "2", "MTK_PIPELINE_LAYERS": "4"}, "must give each of the 2 stages at least one"),
    ],
)
def test_bad_values(env, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig.from_env(env)
