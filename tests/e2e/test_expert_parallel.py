"""Expert parallelism as users run it: ``accelerate launch --config_file accelerate_configs/ep2.yaml
examples/finetune.py --model tiny-qwen3-moe`` (accelerate's ``megatron_lm_expert_model_parallel_size``).

EP is carved out of data parallelism, so its reference is the same run at EP = 1 with the same DP size (each rank
routes and balances its own batch, as plain DP does; the load-balancing loss of a batch is not the mean of its
halves', so one process on the global batch is not the reference). Checkpoints and the saved model hold every
expert by its global index: a checkpoint written at EP 2 resumes at EP 1 and one written at EP 1 at EP 2, and
``--save_model`` writes the directory ``from_pretrained`` loads. The exchange itself against one process, per
model family and with uneven routing, is tests/distributed/test_expert_parallel.py.
"""

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from mtk.cli.main import main as mtk_main
from mtk.testing import assert_close_rel
from tests.e2e.conftest import Run
from tests.e2e.launch import (
    accelerate_launch,
    assert_checkpoint_whole,
    assert_same_losses,
    deepspeed_run,
    finetune,
    one_line_error,
    run_command,
    step_losses,
)

MOE = ("--model", "tiny-qwen3-moe", "--max_steps", "6", "--batch_size", "4")  # a global batch of 8 over DP 2
EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # --lora_target_parameters


@pytest.fixture(scope="module")
def moe_dp2(tmp_path_factory) -> Run:
    """The reference: tiny-qwen3-moe at DP 2 without EP (checkpoints at 3 and 6, the trained model saved)."""
    out_dir = tmp_path_factory.mktemp("moe_dp2")
    losses = finetune("tp1_dp2", out_dir, *MOE, "--save_every", "3", "--save_model", str(out_dir / "model"))
    return Run(out_dir, losses)


def test_ep2_logs_the_dp2_losses_and_its_checkpoints_resume_at_ep1(moe_dp2, tmp_path):
    out = accelerate_launch("finetune.py", "ep2", "--output_dir", str(tmp_path / "run"), *MOE, "--save_every", "3")
    assert "tp=1 pp=1 dp=2 ep=2 world=2" in out.stdout + out.stderr
    assert_same_losses(step_losses(out), moe_dp2.losses, range(1, 7), "ep2 vs dp2")
    assert_checkpoint_whole(tmp_path / "run" / "step_3")
    resumed = finetune("tp1_dp2", tmp_path / "at_ep1", *MOE, "--resume", str(tmp_path / "run" / "step_3"))
    assert_same_losses(resumed, moe_dp2.losses, range(4, 7), "ep2 step 3 resumed at ep1")
    resumed = finetune("ep2", tmp_path / "at_ep2", *MOE, "--resume", str(moe_dp2.dir / "step_3"))
    assert_same_losses(resumed, moe_dp2.losses, range(4, 7), "ep1 step 3 resumed at ep2")


def test_ep2_with_experts_split_over_tp2_saves_the_model_from_pretrained_loads(moe_dp2, tmp_path):
    """accelerate_configs/ep2_tp2.yaml: each expert split over TP 2 (megatron_lm_expert_tensor_parallel_size 2)
    and the experts over EP 2, with the distributed optimizer (the dense state sharded over DP 2); ``--save_model``
    gathers the experts over EP, then over TP, and the step-3 checkpoint (its state gathered from its owners)
    resumes at EP 1 exactly."""
    saved = tmp_path / "model"
    config = _yaml(tmp_path, use_distributed_optimizer="true")
    losses = finetune(config, tmp_path / "run", *MOE, "--save_model", str(saved), "--save_every", "3")
    assert_same_losses(losses, moe_dp2.losses, range(1, 7), "ep2 x tp2 (distributed optimizer) vs dp2")
    assert_checkpoint_whole(tmp_path / "run" / "step_3")
    resumed = finetune("tp1_dp2", tmp_path / "at_ep1", *MOE, "--resume", str(tmp_path / "run" / "step_3"))
    assert_same_losses(resumed, moe_dp2.losses, range(4, 7), "ep2 x tp2 distopt step 3 resumed at ep1")
    ours = dict(AutoModelForCausalLM.from_pretrained(saved).named_parameters())
    theirs = dict(AutoModelForCausalLM.from_pretrained(moe_dp2.dir / "model").named_parameters())
    assert sorted(ours) == sorted(theirs) and any("experts" in name for name in ours)
    for name, param in theirs.items():
        assert_close_rel(ours[name].detach(), param.detach(), f"saved {name}", tol=1e-4)  # after 6 AdamW steps


def test_experts_whole_on_each_tp_rank_log_the_dp2_losses_and_resume_split_and_back(moe_dp2, tmp_path):
    """accelerate_configs/ep2_tp2_etp1.yaml (megatron_lm_expert_tensor_parallel_size 1): every expert whole on each
    TP rank, each running its EP group's experts on its half of the tokens. It logs the DP 2 losses and saves the
    model ``from_pretrained`` loads; its step-3 checkpoint resumes with the experts split over TP (ep2_tp2.yaml),
    and that run's step-4 checkpoint back at the experts' TP size 1, each exactly."""
    saved = tmp_path / "model"
    losses = finetune("ep2_tp2_etp1", tmp_path / "whole", *MOE, "--save_every", "3", "--save_model", str(saved))
    assert_same_losses(losses, moe_dp2.losses, range(1, 7), "ep2 x tp2, experts' tp 1 vs dp2")
    assert_checkpoint_whole(tmp_path / "whole" / "step_3")
    start = ("--resume", str(tmp_path / "whole" / "step_3"), "--save_every", "1")
    split = finetune("ep2_tp2", tmp_path / "split", *MOE, *start)
    assert_same_losses(split, moe_dp2.losses, range(4, 7), "experts' tp 1 step 3 resumed with the experts split")
    back = finetune("ep2_tp2_etp1", tmp_path / "back", *MOE, "--resume", str(tmp_path / "split" / "step_4"))
    assert_same_losses(back, moe_dp2.losses, range(5, 7), "experts split, step 4 resumed whole again")
    ours = dict(AutoModelForCausalLM.from_pretrained(saved).named_parameters())
    theirs = dict(AutoModelForCausalLM.from_pretrained(moe_dp2.dir / "model").named_parameters())
    assert sorted(ours) == sorted(theirs)
    for name, param in theirs.items():
        assert_close_rel(ours[name].detach(), param.detach(), f"saved {name}", tol=1e-4)  # after 6 AdamW steps


def _yaml(tmp_path: Path, **keys: str) -> str:
    """accelerate_configs/ep2_tp2.yaml with some megatron_lm_config keys changed or added."""
    text = Path("accelerate_configs/ep2_tp2.yaml").read_text()
    for key, value in keys.items():
        line = f"  megatron_lm_{key}: "
        if line not in text:
            text = text.replace("megatron_lm_config:\n", f"megatron_lm_config:\n{line}{value}\n")
            continue
        start = text.index(line)
        text = text[:start] + line + value + text[text.index("\n", start) :]
    path = tmp_path / "ep.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"expert_tensor_parallel_size": "3"}, "megatron_lm_expert_tensor_parallel_size) 3: mtk splits each expert"),
        ({"expert_model_parallel_size": "4"}, "expert parallelism 4 does not divide the 2 ranks"),
    ],
)
def test_what_expert_parallelism_cannot_take_is_one_line(tmp_path, keys, message):
    out = accelerate_launch("finetune.py", _yaml(tmp_path, **keys), "--model", "tiny-qwen3-moe", "--output_dir",
                            str(tmp_path / "run"), "--max_steps", "1", check=False)  # fmt: skip
    one_line_error(out, message)


def test_a_dense_model_at_expert_parallelism_is_one_line(tmp_path):
    out = accelerate_launch("finetune.py", "ep2", "--output_dir", str(tmp_path / "run"), "--max_steps", "1",
                            check=False)  # fmt: skip
    one_line_error(out, "LlamaForCausalLM has no mixture-of-experts layer")


def test_an_hf_directory_is_read_slice_by_slice_then_spread_over_ep(moe_dp2, tmp_path):
    """``--model <HF directory>`` at EP 2 x TP 2: each rank reads its TP slice of its own experts only; the first
    step's loss is DP 2's from the same directory."""
    start = ("--model", str(moe_dp2.dir / "model"), "--max_steps", "1", "--batch_size", "4")
    ours = finetune("ep2_tp2", tmp_path / "ep", *start)
    theirs = finetune("tp1_dp2", tmp_path / "dp", *start)
    assert_same_losses(ours, theirs, range(1, 2), "ep2 x tp2 vs dp2 from an HF directory")


def test_ep2_inside_dp4_with_the_distributed_optimizer_resumes_at_ep1_exactly(tmp_path):
    """4 processes at EP 2 with the distributed optimizer: the experts' AdamW moments sharded over their 2 replicas,
    the dense ones over DP 4. Its step-3 checkpoint (each moment gathered from its owner; each EP rank's experts as
    its piece) resumes at EP 1 on the same 4 replicas to the EP 2 run's own steps 4-6."""
    keys = {"tp_degree": "1", "expert_tensor_parallel_size": "1", "use_distributed_optimizer": "true"}
    spread = _yaml(tmp_path, **keys)
    out = accelerate_launch("finetune.py", spread, "--output_dir", str(tmp_path / "run"), *MOE, "--save_every", "3")
    assert "tp=1 pp=1 dp=4 ep=2 world=4" in out.stdout + out.stderr
    losses = step_losses(out)
    assert_checkpoint_whole(tmp_path / "run" / "step_3")
    (tmp_path / "ep1").mkdir()
    whole = _yaml(tmp_path / "ep1", **{**keys, "expert_model_parallel_size": "1"})
    resumed = finetune(whole, tmp_path / "at_ep1", *MOE, "--resume", str(tmp_path / "run" / "step_3"))
    assert_same_losses(resumed, losses, range(4, 7), "ep2 x dp4 distopt step 3 resumed at ep1")


ACCUMULATING = ("--model", "tiny-qwen3-moe", "--max_steps", "6")


@pytest.fixture(scope="module")
def dp2_accumulating(tmp_path_factory) -> dict[int, float]:
    """The reference losses of DP 2 accumulating 2 micro-batches of 2 rows (each its own load-balancing term)."""
    out_dir = tmp_path_factory.mktemp("moe_dp2_accumulating")
    return finetune("tp1_dp2", out_dir, *ACCUMULATING, "--batch_size", "2", "--grad_accum", "2")


def test_ep2_inside_a_pp2_pipeline_logs_the_accumulated_dp2_losses_and_resumes_at_ep1(dp2_accumulating, tmp_path):
    """TP 1 x PP 2 x DP 2 with EP 2 over the DP pairs of each stage, the load-balancing term carried through the
    stages with each micro-batch's hidden states: the losses of DP 2 accumulating the same 2 micro-batches of 2 rows
    (each its own term; padded rows, the padding left out), as one process accumulating gradients computes them.
    The step-3 checkpoint (each stage's experts in its EP ranks' pieces) resumes at EP 1 in the same pipeline."""
    run, reference = ACCUMULATING, dp2_accumulating
    keys = {"pp_degree": "2", "tp_degree": "1", "expert_tensor_parallel_size": "1", "num_micro_batches": "2"}
    out = accelerate_launch("finetune.py", _yaml(tmp_path, **keys), "--output_dir", str(tmp_path / "run"), *run,
                            "--batch_size", "4", "--save_every", "3")  # fmt: skip
    assert "tp=1 pp=2 (1f1b, 2 micro-batches) dp=2 ep=2 world=4" in out.stdout + out.stderr
    assert_same_losses(step_losses(out), reference, range(1, 7), "pp2 x ep2 vs dp2 accumulating 2")
    assert_checkpoint_whole(tmp_path / "run" / "step_3")
    (tmp_path / "ep1").mkdir()
    at_ep1 = _yaml(tmp_path / "ep1", **{**keys, "expert_model_parallel_size": "1"})
    resumed = finetune(
        at_ep1, tmp_path / "at_ep1", *run, "--batch_size", "4", "--resume", str(tmp_path / "run" / "step_3")
    )
    assert_same_losses(resumed, reference, range(4, 7), "pp2 x ep2 step 3 resumed at pp2 x ep1")


def test_lora_on_the_experts_inside_a_pp2_pipeline_at_ep2_logs_the_accumulated_dp2_losses(tmp_path):
    """LoRA on the linears and the expert tensors at TP 1 x PP 2 x DP 2 with EP 2: each stage's experts' factors
    spread with its experts and reduced over their replicas beside the pipeline's DP reduction of the other
    adapters; the losses of DP 2 accumulating the same 2 micro-batches with the same adapters."""
    lora = ("--lora_r", "4", "--lora_target_parameters", ",".join(EXPERT_TENSORS))
    reference = finetune("tp1_dp2", tmp_path / "dp2", *ACCUMULATING, *lora, "--batch_size", "2", "--grad_accum", "2")
    keys = {"pp_degree": "2", "tp_degree": "1", "expert_tensor_parallel_size": "1", "num_micro_batches": "2"}
    out = accelerate_launch("finetune.py", _yaml(tmp_path, **keys), "--output_dir", str(tmp_path / "run"),
                            *ACCUMULATING, *lora, "--batch_size", "4")  # fmt: skip
    assert "dp=2 ep=2" in out.stdout + out.stderr
    assert_same_losses(step_losses(out), reference, range(1, 7), "LoRA pp2 x ep2 vs dp2 accumulating 2")


def test_experts_whole_on_each_tp_rank_accumulating_log_the_accumulated_dp2_losses(dp2_accumulating, tmp_path):
    """ep2_tp2_etp1.yaml accumulating 2 micro-batches: the whole experts' gradients (and Qwen3's q/k norms') are
    summed over TP once per step, after the last micro-batch's backward, not in each backward; the losses are DP 2's
    accumulating the same micro-batches."""
    out = accelerate_launch("finetune.py", "ep2_tp2_etp1", "--output_dir", str(tmp_path / "run"), *ACCUMULATING,
                            "--batch_size", "2", "--grad_accum", "2")  # fmt: skip
    assert "ep=2 etp=1" in out.stdout + out.stderr
    assert_same_losses(step_losses(out), dp2_accumulating, range(1, 7), "ep2 x tp2 etp1 accumulating vs dp2")


def test_ep2_under_deepspeed_zero2_logs_the_dp2_losses_and_resumes_exactly(moe_dp2, tmp_path):
    """accelerate_configs/ep2_zero2.yaml: EP 2 over DP 2 under DeepSpeed ZeRO-2, the experts reduced and partitioned
    over their replicas through DeepSpeed's own MoE parameter groups, the dense parameters over DP. It logs the DP 2
    (DDP) losses; its step-3 checkpoint resumes at its own layout exactly (each rank's experts read back from mtk's
    files) and, at EP 1, is one line; its step-6 checkpoint exports the model ``from_pretrained`` loads."""
    run = ("--output_dir", str(tmp_path / "run"), *MOE, "--save_every", "3")
    out = accelerate_launch("finetune.py", "ep2_zero2", *run)
    assert "tp=1 pp=1 dp=2 ep=2 world=2" in out.stdout + out.stderr
    assert_same_losses(step_losses(out), moe_dp2.losses, range(1, 7), "ep2 under ZeRO-2 vs dp2")
    assert_checkpoint_whole(tmp_path / "run" / "step_3")
    resumed = finetune("ep2_zero2", tmp_path / "again", *MOE, "--resume", str(tmp_path / "run" / "step_3"))
    assert_same_losses(resumed, moe_dp2.losses, range(4, 7), "ep2 under ZeRO-2, step 3 resumed")
    config = json.loads(Path("ds_configs/accelerate_zero2_ep2.json").read_text())
    config["mtk"] = {}
    (tmp_path / "ep1.json").write_text(json.dumps(config))
    yaml = Path("accelerate_configs/ep2_zero2.yaml").read_text()
    yaml = yaml.replace("ds_configs/accelerate_zero2_ep2.json", str(tmp_path / "ep1.json"))
    (tmp_path / "ep1.yaml").write_text(yaml)
    out = accelerate_launch("finetune.py", str(tmp_path / "ep1.yaml"), "--output_dir", str(tmp_path / "at_ep1"), *MOE,
                            "--resume", str(tmp_path / "run" / "step_3"), check=False)  # fmt: skip
    one_line_error(out, "dp=2 ep=2 etp=1 with ZeRO stage 2, this run is tp=1 cp=1 pp=1 dp=2 with stage 2")
    assert mtk_main(["export", str(tmp_path / "run" / "step_6"), str(tmp_path / "hf")]) == 0
    ours = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "hf").named_parameters())
    theirs = dict(AutoModelForCausalLM.from_pretrained(moe_dp2.dir / "model").named_parameters())
    for name, param in theirs.items():
        assert_close_rel(ours[name].detach(), param.detach(), f"exported {name}", tol=1e-4)  # after 6 AdamW steps


def _planned_deepspeed_state(world: int, lora: bool) -> tuple[int, int]:
    """(parameter, optimizer-state) elements ``mtk plan`` puts on a rank of tiny-qwen3-moe at DP ``world`` x EP 2
    under ZeRO-2 in fp32 (weights 4 bytes an element, AdamW's two moments 8)."""
    from mtk.models import builtin_config
    from mtk.planner.cluster import Cluster
    from mtk.planner.layouts import Request
    from mtk.planner.search import plan

    adapters = {"lora_r": 4, "lora_target_parameters": EXPERT_TENSORS} if lora else {}
    cluster = Cluster(world, gpu_memory=8 << 30)
    request = Request(builtin_config("tiny-qwen3-moe"), cluster, 64, 2 * world, dtype="fp32", reserve=0,
                      ep_sizes=(2,), engines=("deepspeed",), **adapters)  # fmt: skip
    entry = next(e for e in plan(request) if e.candidate.label.endswith(" zero2"))
    assert f"dp{world} ep2" in entry.candidate.label, entry.candidate.label
    return entry.memory.weights // 4, entry.memory.optimizer // 4


@pytest.mark.parametrize(("world", "lora"), [(2, False), (4, False), (2, True)], ids=["dp2", "dp4", "dp2-lora"])
def test_the_plan_of_expert_parallelism_under_deepspeed_is_the_state_a_run_holds(tmp_path, world, lora):
    """``mtk plan --ep 2 --engine deepspeed``: ZeRO-2 partitions the dense state over DP and DeepSpeed's MoE
    parameter groups (the spread experts, or their LoRA factors) over the DP / EP ranks holding the same experts;
    the parameter and optimizer-state elements it plans for a rank are the ones rank 0 of such a run holds (at DP 4
    each expert has two holders, which split its moments)."""
    yaml = Path("accelerate_configs/ep2_zero2.yaml").read_text()
    (tmp_path / "run.yaml").write_text(yaml.replace("num_processes: 2", f"num_processes: {world}"))
    adapters = ("--lora_r", "4", "--lora_target_parameters", ",".join(EXPERT_TENSORS)) if lora else ()
    run = ("--output_dir", str(tmp_path / "run"), "--model", "tiny-qwen3-moe", "--max_steps", "1", "--batch_size", "2")
    out = accelerate_launch("finetune.py", str(tmp_path / "run.yaml"), *run, *adapters)
    held = re.search(r"model state held by rank 0: (\d+) parameter elements, (\d+) optimizer-state", out.stdout)
    assert held and f"dp={world} ep=2" in out.stdout + out.stderr, out.stdout[-2000:]
    assert (int(held[1]), int(held[2])) == _planned_deepspeed_state(world, lora)


def test_deepspeeds_launcher_at_ep2_logs_its_ep1_losses_and_resumes_exactly(tmp_path):
    """``deepspeed ... examples/run.py --ep 2`` under ds_configs/zero2.json logs the same run's losses at EP 1 (the
    DeepSpeed path's own: within 1e-5 of finetune.py's), and its step-3 checkpoint resumes to them."""
    run = ("--model", "tiny-qwen3-moe", "--max_steps", "6", "--batch_size", "4")
    whole = deepspeed_run(2, "zero2", *run, "--output_dir", str(tmp_path / "ep1"))
    spread = deepspeed_run(2, "zero2", "--ep", "2", *run, "--save_every", "3", "--output_dir", str(tmp_path / "ep2"))
    assert "tp=1 dp=2 ep=2," in spread.stdout
    assert_same_losses(step_losses(spread), step_losses(whole), range(1, 7), "run.py ep2 vs ep1")
    again = deepspeed_run(2, "zero2", "--ep", "2", *run, "--resume", str(tmp_path / "ep2" / "step_3"),
                          "--output_dir", str(tmp_path / "again"))  # fmt: skip
    assert_same_losses(step_losses(again), step_losses(whole), range(4, 7), "run.py ep2 step 3 resumed")


def test_whole_experts_under_deepspeed_zero1_accumulating_log_the_accumulated_dp2_losses(dp2_accumulating, tmp_path):
    """TP 2 x DP 2 with EP 2 and every expert whole on each TP rank (the experts' TP size 1) under ZeRO-1,
    accumulating 2 micro-batches (the whole experts' gradients summed over TP in backward, DeepSpeed reducing in
    it): DP 2's losses accumulating the same micro-batches."""
    config = json.loads(Path("ds_configs/accelerate_zero2_ep2.json").read_text())
    config["zero_optimization"]["stage"] = 1
    config["mtk"].update(tensor_parallel_size=2, expert_tensor_parallel_size=1)
    (tmp_path / "ds.json").write_text(json.dumps(config))
    yaml = Path("accelerate_configs/ep2_zero2.yaml").read_text()
    yaml = yaml.replace("ds_configs/accelerate_zero2_ep2.json", str(tmp_path / "ds.json"))
    (tmp_path / "ep.yaml").write_text(yaml.replace("num_processes: 2", "num_processes: 4"))
    out = accelerate_launch("finetune.py", str(tmp_path / "ep.yaml"), "--output_dir", str(tmp_path / "run"),
                            *ACCUMULATING, "--batch_size", "2", "--grad_accum", "2")  # fmt: skip
    assert "tp=2 pp=1 dp=2 ep=2 etp=1 world=4" in out.stdout + out.stderr
    assert_same_losses(step_losses(out), dp2_accumulating, range(1, 7), "ep2 x tp2 etp1 under ZeRO-1 vs dp2")


def test_lora_at_ep2_logs_the_dp2_losses_resumes_at_ep1_and_exports(moe_dp2, tmp_path):
    """LoRA on the linears (PEFT on mtk's linears) and on the expert tensors themselves (PEFT's target_parameters,
    --lora_target_parameters) while the experts are spread over EP 2: each rank holds its own experts' part of the
    experts' factors. The DP 2 LoRA run's losses; the adapter-only checkpoint records the base's fingerprint with
    every expert counted once (its first holder adds it) and the factors by global expert, so it resumes on the same
    base at EP 1, and the DP 2 run's checkpoint at EP 2; it exports as a PEFT adapter directory and merged into the
    base, which from_pretrained loads and which computes what PEFT computes with the adapter on one process. Under
    DeepSpeed ZeRO-2 (ep2_zero2.yaml) the same run logs the same losses and resumes exactly."""
    from peft import PeftModel

    experts = ",".join(EXPERT_TENSORS)
    base = str(moe_dp2.dir / "model")
    lora = ("--model", base, *MOE[2:], "--lora_r", "4", "--lora_target_parameters", experts)
    reference = finetune("tp1_dp2", tmp_path / "dp2", *lora, "--save_every", "3")
    out = accelerate_launch("finetune.py", "ep2", "--output_dir", str(tmp_path / "run"), *lora, "--save_every", "3")
    assert "LoRA all-linear" in out.stdout + out.stderr and "ep=2" in out.stdout + out.stderr
    assert_same_losses(step_losses(out), reference, range(1, 7), "LoRA at ep2 vs dp2")
    assert_checkpoint_whole(tmp_path / "run" / "step_3")
    resumed = finetune("tp1_dp2", tmp_path / "at_ep1", *lora, "--resume", str(tmp_path / "run" / "step_3"))
    assert_same_losses(resumed, reference, range(4, 7), "LoRA ep2 step 3 resumed at ep1")
    at_ep2 = accelerate_launch(
        "finetune.py", "ep2", "--output_dir", str(tmp_path / "at_ep2"), *lora, "--resume", str(tmp_path / "dp2/step_3")
    )
    assert_same_losses(step_losses(at_ep2), reference, range(4, 7), "LoRA dp2 step 3 resumed at ep2")
    # under DeepSpeed ZeRO-2 the experts' factors are its MoE parameters (the frozen experts marked too)
    ds_run = ("--output_dir", str(tmp_path / "ds"), *lora, "--save_every", "3")
    ds = accelerate_launch("finetune.py", "ep2_zero2", *ds_run)
    assert_same_losses(step_losses(ds), reference, range(1, 7), "LoRA at ep2 under ZeRO-2 vs dp2")
    ds_resumed = finetune("ep2_zero2", tmp_path / "ds_again", *lora, "--resume", str(tmp_path / "ds" / "step_3"))
    assert_same_losses(ds_resumed, reference, range(4, 7), "LoRA at ep2 under ZeRO-2, step 3 resumed")
    step = str(tmp_path / "run" / "step_6")
    for kind in ("--adapter", "--merge"):
        export = run_command([sys.executable, "-m", "mtk.cli.main", "export", step, str(tmp_path / kind[2:]), kind])
        assert export.returncode == 0, export.stderr[-2000:]
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter").eval()
    assert any("experts.lora_A" in name for name, _ in adapted.named_parameters())
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merge").eval()
    ids = torch.arange(1, 17).reshape(2, 8)
    with torch.no_grad():
        assert_close_rel(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, "merged vs PEFT logits")


def test_fsdp2_with_ep2_logs_the_dp2_losses_and_its_checkpoint_resumes_without_either(moe_dp2, tmp_path):
    """FSDP2 over DP 2 (accelerate's FSDP yaml) with EP 2 from the environment, as a pipeline size is given next to
    FSDP2: the dense parameters sharded, the spread experts left whole and reduced over their replicas. The step-3
    checkpoint, FSDP2's pieces with each expert saved by its first holder, resumes at plain DP 2 and EP 1."""
    text = Path("accelerate_configs/tp2_fsdp2.yaml").read_text()
    config = tmp_path / "fsdp2_dp2.yaml"
    config.write_text(text.replace("num_processes: 4", "num_processes: 2").replace("tp_size: 2", "tp_size: 1"))
    env = {**os.environ, "MEGATRON_LM_EXPERT_MODEL_PARALLEL_SIZE": "2"}
    out = accelerate_launch("finetune.py", str(config), "--output_dir", str(tmp_path / "run"), *MOE, "--save_every",
                            "3", env=env)  # fmt: skip
    assert "FSDP2 over data parallelism" in out.stdout + out.stderr and "dp=2 ep=2" in out.stdout + out.stderr
    assert_same_losses(step_losses(out), moe_dp2.losses, range(1, 7), "fsdp2 x ep2 vs dp2")
    assert_checkpoint_whole(tmp_path / "run" / "step_3")
    resumed = finetune("tp1_dp2", tmp_path / "at_ep1", *MOE, "--resume", str(tmp_path / "run" / "step_3"))
    assert_same_losses(resumed, moe_dp2.losses, range(4, 7), "fsdp2 x ep2 step 3 resumed at dp2")
