"""Context parallelism as users run it: ``accelerate launch --config_file accelerate_configs/tp2_cp2.yaml
examples/finetune.py`` (accelerate's ``megatron_lm_context_parallel_size``), against the single-process run.

CP is not a shard axis of a checkpoint: a TP2 x CP2 checkpoint resumes at TP=1 exactly, a TP=1 one at CP=2, and
``mtk export`` writes the single-process model. Under DeepSpeed, CP is its sequence parallelism (ZeRO-2 and ZeRO-3).
Packed documents at TP2 x CP2 (and x PP2) are in tests/e2e/test_chat_data.py; the Trainer, TRL (SFT with
packing, DPO) and LoRA at TP2 x CP2 in test_trainers.py, test_trl.py and test_lora.py.
"""

import re
from pathlib import Path

import pytest
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mtk.models import resolve_config
from mtk.testing import assert_close_rel
from tests.e2e.conftest import Run
from tests.e2e.launch import (
    accelerate_launch,
    assert_same_losses,
    deepspeed_run,
    finetune,
    logged,
    run_command,
    step_losses,
)


@pytest.fixture(scope="module")
def tp2_cp2(tmp_path_factory) -> Run:
    """The shared reference run (6 steps, checkpoints at 3 and 6) at TP2 x CP2."""
    out_dir = tmp_path_factory.mktemp("tp2_cp2")
    return Run(out_dir, finetune("tp2_cp2", out_dir, "--max_steps", "6", "--save_every", "3"))


def test_tp2_cp2_logs_the_tp1_losses(tp2_cp2, llama_tp1):
    assert_same_losses(tp2_cp2.losses, llama_tp1.losses, range(1, 7), "tp2_cp2 vs tp1")


def test_a_tp2_cp2_checkpoint_resumes_at_tp1_and_a_tp1_one_at_cp2(tp2_cp2, llama_tp1, tmp_path):
    resumed = finetune("tp1", tmp_path / "at_tp1", "--max_steps", "6", "--resume", str(tp2_cp2.dir / "step_3"))
    assert_same_losses(resumed, llama_tp1.losses, range(4, 7), "tp2_cp2 step 3 resumed at tp1")
    resumed = finetune(
        "cp2", tmp_path / "at_cp2", "--max_steps", "6", "--resume", str(llama_tp1.dir / "step_3"), "--cp_comm_type",
        "a2a",
    )  # fmt: skip
    assert_same_losses(resumed, llama_tp1.losses, range(4, 7), "tp1 step 3 resumed at cp2 (a2a)")


def test_export_of_a_tp2_cp2_checkpoint_is_the_tp1_model(tp2_cp2, llama_tp1, tmp_path):
    for name, run in (("cp", tp2_cp2), ("tp1", llama_tp1)):
        out = run_command(["mtk", "export", str(run.dir / "step_6"), str(tmp_path / name)])
        assert out.returncode == 0, out.stderr[-2000:]
    ours, theirs = (load_file(tmp_path / name / "model.safetensors") for name in ("cp", "tp1"))
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert_close_rel(ours[key], theirs[key], f"exported {key}", tol=1e-4)  # after 6 AdamW steps in fp32


def test_fsdp2_shards_over_dp_and_cp_logs_the_tp1_losses_and_resumes_at_tp1(llama_tp1, tmp_path):
    """accelerate_configs/cp2_fsdp2.yaml (parallelism_config cp_size 2 x dp_shard_size 2): each rank holds a quarter
    of the model state (the CP ranks hold the same weights, so FSDP2 shards over them too, accelerate's
    dp_shard_cp); half the micro-batch per DP rank: the same global batch."""
    out = accelerate_launch(
        "finetune.py", "cp2_fsdp2", "--output_dir", str(tmp_path / "run"), "--max_steps", "6", "--save_every", "3",
        "--batch_size", "4",
    )  # fmt: skip
    assert_same_losses(step_losses(out), llama_tp1.losses, range(1, 7), "cp2 x fsdp2 vs tp1")
    assert "each TP shard split over 4 ranks (dp_shard_size x cp_size 2" in out.stdout + out.stderr
    held = int(re.search(r"model state held by rank 0: (\d+) parameter elements", out.stdout + out.stderr)[1])
    whole = sum(t.numel() for t in load_file(llama_tp1.dir / "step_6" / "model" / "tp00-pp00.safetensors").values())
    assert whole / 4 <= held < whole / 4 * 1.01  # a quarter (each piece padded to whole rows)
    resumed = finetune("tp1", tmp_path / "at_tp1", "--max_steps", "6", "--resume", str(tmp_path / "run" / "step_3"))
    assert_same_losses(resumed, llama_tp1.losses, range(4, 7), "cp2 x fsdp2 step 3 resumed at tp1")


def _yaml(tmp_path: Path, name: str, **keys: str) -> str:
    """accelerate_configs/tp2_cp2.yaml with some megatron_lm_config keys changed or added."""
    text = Path("accelerate_configs/tp2_cp2.yaml").read_text()
    for key, value in keys.items():
        line = f"  megatron_lm_{key}: "
        if line in text:
            start = text.index(line)
            text = text[:start] + line + value + text[text.index("\n", start) :]
        else:
            text = text.replace("megatron_lm_config:\n", f"megatron_lm_config:\n{line}{value}\n")
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return str(path)


def test_sequence_parallelism_and_selective_recompute_inside_all_to_all_cp(llama_tp1, tmp_path):
    """Rows padded to a multiple of 2 x cp and of cp x tp (SP cuts each rank's tokens again); the attention reruns
    in backward under selective recompute, as Megatron's core-attention recompute does."""
    config = _yaml(tmp_path, "sp", sequence_parallelism="true", recompute_activations="true")
    losses = finetune(config, tmp_path / "run", "--max_steps", "6", "--cp_comm_type", "a2a")
    assert_same_losses(losses, llama_tp1.losses, range(1, 7), "tp2_cp2 sp recompute a2a vs tp1")


def test_dp_x_cp_replicas_average_gradients_and_shard_the_optimizer(llama_tp1, tmp_path):
    """4 processes at CP 2: DP 2 reads two batches, each split over its CP pair; DDP averages over all four (the DP x
    CP replicas) and the distributed optimizer shards its state over them: the TP=1 losses at the same global batch."""
    config = _yaml(tmp_path, "cp2_dp2", tp_degree="1", use_distributed_optimizer="true")
    out = accelerate_launch("finetune.py", config, "--output_dir", str(tmp_path / "run"), "--max_steps", "6",
                            "--batch_size", "4")  # fmt: skip
    assert "tp=1 cp=2 (p2p) pp=1 dp=2 world=4" in out.stdout + out.stderr
    assert_same_losses(step_losses(out), llama_tp1.losses, range(1, 7), "cp2 x dp2 distopt vs tp1")


def test_deepspeed_sums_over_cp_as_its_sequence_parallelism_and_logs_the_tp1_losses(llama_tp1, tmp_path):
    """accelerate_configs/tp2_cp2_zero2.yaml (the JSON's "mtk" block: tensor_parallel_size 2, context_parallel_size
    2): ZeRO-2 partitions and reduces over the DP x CP ranks; its checkpoint resumes at its own layout exactly."""
    run = tmp_path / "zero2"
    losses = finetune("tp2_cp2_zero2", run, "--max_steps", "6", "--save_every", "3")
    assert_same_losses(losses, llama_tp1.losses, range(1, 7), "tp2 cp2 zero2 vs tp1")
    assert_same_losses(logged(run), logged(llama_tp1.dir), range(1, 7), "tp2 cp2 zero2 gradient norm vs tp1")
    resumed = finetune("tp2_cp2_zero2", tmp_path / "resumed", "--max_steps", "6", "--resume", str(run / "step_3"))
    assert_same_losses(resumed, llama_tp1.losses, range(4, 7), "tp2 cp2 zero2 resumed at step 3")


def test_zero3_partitions_over_dp_x_cp_and_resumes_at_another_cp_size(llama_tp1, tmp_path):
    """ZeRO-3 partitions every parameter over the DP x CP ranks (mtk partitions the model before DeepSpeed, which
    would split it over DP alone and leave each CP rank stepping on its own part of the sequence): the TP1 losses
    at TP2 x CP2 (accelerate_configs/tp2_cp2_zero3.yaml); its step-3 checkpoint resumes at TP2 x DP2 (same global
    batch); ``deepspeed ... examples/run.py --cp 2`` under ZeRO-3 holds half the parameters and logs the same."""
    run = tmp_path / "zero3"
    losses = finetune("tp2_cp2_zero3", run, "--max_steps", "6", "--save_every", "3")
    assert_same_losses(losses, llama_tp1.losses, range(1, 7), "tp2 cp2 zero3 vs tp1")
    # the gradient norm too: clipping at 1.0 and AdamW would hide a gradient off by a constant factor in the losses
    assert_same_losses(logged(run), logged(llama_tp1.dir), range(1, 7), "tp2 cp2 zero3 gradient norm vs tp1")
    resumed = finetune("tp2_dp2_zero3", tmp_path / "dp2", "--max_steps", "6", "--batch_size", "4",
                       "--resume", str(run / "step_3"))  # fmt: skip
    assert_same_losses(resumed, llama_tp1.losses, range(4, 7), "tp2 cp2 zero3 step 3 resumed at tp2 dp2")
    out = deepspeed_run(2, "zero3", "--cp", "2", "--batch_size", "8", "--max_steps", "6", "--output_dir",
                        str(tmp_path / "run_py"))  # fmt: skip
    assert "tp=1 cp=2 dp=1" in out.stdout
    assert_same_losses(step_losses(out), llama_tp1.losses, range(1, 7), "run.py cp2 zero3 vs tp1")
    assert_same_losses(logged(tmp_path / "run_py"), logged(llama_tp1.dir), range(1, 7), "run.py zero3 gradient norm")
    held = re.search(r"model state held by rank 0: (\d+) parameter elements", out.stdout)
    model = AutoModelForCausalLM.from_config(resolve_config("tiny-llama"))
    assert held is not None and int(held[1]) * 2 == sum(p.numel() for p in model.parameters())  # split over CP
