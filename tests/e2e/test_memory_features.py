"""Sequence parallelism and activation recomputation as users turn them on: accelerate's own
``megatron_lm_config`` keys. They save memory and change no number: every layout logs the single-process
losses (fp32, relative error <= 1e-5), and a run with dropout resumes exactly (both random streams are
checkpointed). Keys mtk cannot honour stop the run with one line naming them.
"""

from pathlib import Path

import pytest
import torch
import yaml

from mtk.testing import RTOL, max_rel_error
from tests.e2e.launch import ROOT, accelerate_launch, assert_same_losses, finetune, one_line_error, step_losses


def _yaml(tmp_path: Path, base: str, **megatron) -> str:
    """accelerate_configs/<base>.yaml with ``megatron_lm_<key>: value`` set."""
    config = yaml.safe_load((ROOT / "accelerate_configs" / f"{base}.yaml").read_text())
    config["megatron_lm_config"].update({f"megatron_lm_{key}": value for key, value in megatron.items()})
    path = tmp_path / f"{base}-{'-'.join(megatron)}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize("config", ["tp2_sp", "tp2_sp_recompute"])
def test_sequence_parallel_and_recompute_log_the_tp1_losses(config, llama_tp1, tmp_path):
    run = finetune(config, tmp_path, "--max_steps", "6")
    assert_same_losses(run, llama_tp1.losses, range(1, 7), config)


def test_pipeline_data_parallel_sequence_parallel_selective_recompute(llama_tp1, tmp_path):
    """TP=2 x PP=2 x DP=2 with SP, selective recompute and an uneven split from accelerate's own key."""
    config = _yaml(
        tmp_path,
        "tp2_pp2_dp2",
        sequence_parallelism=True,
        recompute_activations=True,
        decoder_last_pipeline_num_layers=1,
    )
    out = accelerate_launch(
        "finetune.py", config, "--output_dir", str(tmp_path / "out"), "--max_steps", "6", "--batch_size", "4"
    )
    assert_same_losses(step_losses(out), llama_tp1.losses, range(1, 7), "tp2_pp2_dp2 + sp + selective recompute")


def test_packed_rows_under_sequence_parallelism(tmp_path):
    packed = ("--max_steps", "3", "--packing", "--seq_len", "64")
    tp1 = finetune("tp1", tmp_path / "tp1", *packed)
    sp = finetune("tp2_sp", tmp_path / "sp", *packed)
    assert_same_losses(sp, tp1, range(1, 4), "packed, tp2_sp")


@pytest.fixture(scope="module")
def dropout_model(tmp_path_factory) -> Path:
    """The tiny Llama with attention dropout 0.2, as a local HF directory."""
    from mtk.models import build_model, builtin_config

    config = builtin_config("tiny-llama")
    config.attention_dropout = 0.2
    config._attn_implementation = "eager"
    directory = tmp_path_factory.mktemp("dropout") / "model"
    build_model(config, seed=0).save_pretrained(directory)
    return directory


def test_dropout_run_resumes_exactly(dropout_model, llama_tp1, tmp_path):
    """The run without dropout is the shared TP=1 one (6 steps): tp2_sp_recompute logs its losses within the
    bar (test above), so the dropout run must differ from it by more than the bar."""
    args = ("--model", str(dropout_model), "--tokenizer", "bytes", "--max_steps", "6", "--save_every", "3")
    full = finetune("tp2_sp_recompute", tmp_path / "full", *args)
    rng = torch.load(tmp_path / "full" / "step_3" / "rng" / "rank00001.pt", weights_only=True)
    assert "tensor-parallel" in rng["streams"], "the TP dropout stream is checkpointed"
    resumed = finetune("tp2_sp_recompute", tmp_path / "resumed", *args, "--resume", str(tmp_path / "full" / "step_3"))
    assert_same_losses(resumed, full, [4, 5, 6], "resumed with dropout")
    no_dropout = llama_tp1.losses
    assert max_rel_error(full[6], no_dropout[6]) > RTOL, "dropout is on: the check would prove nothing otherwise"


@pytest.mark.parametrize(
    "key, message",
    [
        ("optimizer_cpu_offload", "megatron_lm_optimizer_cpu_offload: True is not supported"),
        ("sequence_paralellism", "'megatron_lm_sequence_paralellism' is unknown to accelerate, which drops it"),
    ],
    ids=["refused", "misspelt"],
)
def test_a_key_mtk_cannot_honour_or_accelerate_drops_is_one_line(tmp_path, key, message):
    """A misspelt key never reaches the workers' environment: mtk reads the launcher's YAML for it. Every other
    refusal is a unit test of the key table (tests/unit/test_megatron_keys.py)."""
    config = _yaml(tmp_path, "tp2", **{key: True})
    # real: mtk finds the YAML on the command line of the `accelerate launch` its ranks descend from
    out = accelerate_launch("finetune.py", config, "--max_steps", "1", check=False, real=True)
    one_line_error(out, message)


def test_distributed_optimizer_logs_the_tp1_losses_and_resumes_without_it(llama_tp1, tmp_path):
    """tp2_pp2_dp2_distopt.yaml (ZeRO-1 over DP without DeepSpeed); its checkpoint is in mtk's layout, so a
    run at TP=2 x DP=2 with the plain optimizer resumes it exactly (PP resharded, the state unsharded)."""
    args = ("--max_steps", "6", "--batch_size", "4")
    sharded = finetune("tp2_pp2_dp2_distopt", tmp_path / "sharded", *args, "--save_every", "3")
    assert_same_losses(sharded, llama_tp1.losses, range(1, 7), "tp2_pp2_dp2_distopt")
    resumed = finetune("tp2_dp2", tmp_path / "plain", *args, "--resume", str(tmp_path / "sharded" / "step_3"))
    assert_same_losses(resumed, sharded, [4, 5, 6], "tp2_dp2 resumed from the distributed optimizer's step 3")


def test_fsdp2_through_accelerates_parallelism_config_logs_the_tp1_losses_and_resumes_without_it(llama_tp1, tmp_path):
    """accelerate_configs/tp2_fsdp2.yaml (distributed_type FSDP, fsdp_version 2, parallelism_config tp_size 2 x
    dp_shard_size 2): each TP shard split again over DP; its checkpoint is mtk's, resumed exactly at plain
    TP2 x DP2."""
    args = ("--max_steps", "6", "--batch_size", "4")
    sharded = finetune("tp2_fsdp2", tmp_path / "sharded", *args, "--save_every", "3")
    assert_same_losses(sharded, llama_tp1.losses, range(1, 7), "tp2_fsdp2")
    resumed = finetune("tp2_dp2", tmp_path / "plain", *args, "--resume", str(tmp_path / "sharded" / "step_3"))
    assert_same_losses(resumed, sharded, [4, 5, 6], "tp2_dp2 resumed from FSDP2's step 3")
