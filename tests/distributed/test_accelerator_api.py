"""accelerate APIs that accelerate's own scripts do not cover, at TP=2 x DP=2 (4 gloo processes).

One launch checks: the parallel-rank properties, ``split_between_processes`` over DP replicas,
``prepare_model`` then ``prepare_optimizer`` called separately (the optimizer follows the shards),
``save_model`` writing the full HF state dict, save/load pre-hooks, automatic checkpoint naming with
``total_limit``, ``gather_for_metrics`` of objects, pickling, the collective timeout of an
``InitProcessGroupKwargs`` reaching every mtk group, and the one-line refusal of accelerate's
``parallelism_config``.
"""

import contextlib
import pickle
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from mtk.testing import run_distributed


def _check_api(rank, world_size, out_dir):
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import InitProcessGroupKwargs
    from safetensors.torch import load_file

    from mtk import Accelerator, ParallelConfig
    from mtk.config import ConfigError
    from mtk.models import build_model
    from mtk.parallel.state import group_timeout

    # 600 s equals accelerate's NCCL default, which its to_kwargs drops: the gloo world would keep 1800 s
    timeout = timedelta(seconds=600)
    accelerator = Accelerator(
        parallel_config=ParallelConfig(tp_size=2), kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)]
    )
    state = accelerator.parallel
    assert group_timeout() == timeout and group_timeout(state.tp_group) == timeout == group_timeout(state.dp_group)
    assert (accelerator.tensor_parallel_rank, accelerator.data_parallel_rank) == (state.tp_rank, state.dp_rank)
    assert accelerator.pipeline_parallel_rank == 0 and accelerator.data_parallel_shard_rank == 0

    with accelerator.split_between_processes(list(range(6))) as piece:
        assert piece == [[0, 1, 2], [3, 4, 5]][state.dp_rank], piece  # TP peers get the same piece

    copy = pickle.loads(pickle.dumps(accelerator))  # before a model is prepared: torch's DDP over a sub-group
    assert copy.parallel.tp_group is state.tp_group and copy.parallel.dp_rank == state.dp_rank  # cannot pickle

    model = build_model("tiny-llama", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model = accelerator.prepare_model(model)
    optimizer = accelerator.prepare_optimizer(optimizer)
    model_params = {id(p) for p in model.parameters()}
    assert all(id(p) in model_params for g in optimizer.param_groups for p in g["params"]), "optimizer not re-pointed"
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(model_params)

    hooks = []
    accelerator.register_save_state_pre_hook(lambda models, weights, path: hooks.append(("save", path)))
    accelerator.register_load_state_pre_hook(lambda models, path: hooks.append(("load", path)))
    accelerator.save_state(f"{out_dir}/state")
    accelerator.load_state(f"{out_dir}/state")
    assert hooks == [("save", f"{out_dir}/state"), ("load", f"{out_dir}/state")], hooks

    gathered = accelerator.gather_for_metrics([f"dp{state.dp_rank}"], use_gather_object=True)
    assert gathered == ["dp0", "dp1"], gathered
    value = torch.tensor([1.0 + state.dp_rank])  # each replica's metric, held by both its TP ranks
    reduced = {how: accelerator.reduce(value, how).item() for how in ("sum", "mean", "max", "none")}
    assert reduced == {"sum": 3.0, "mean": 1.5, "max": 2.0, "none": 3.0}, reduced  # accelerate's, over DP
    with pytest.raises(ConfigError, match=r"reduce: scale=2\.0 is applied by accelerate on XLA only"):
        accelerator.reduce(value, scale=2.0)

    accelerator.project_configuration.set_directories(f"{out_dir}/project")
    accelerator.project_configuration.automatic_checkpoint_naming = True
    accelerator.project_configuration.total_limit = 2
    for _ in range(3):
        accelerator.save_state()  # accelerate's checkpoint_<i>, at most total_limit kept
    kept = sorted(p.name for p in (Path(out_dir) / "project" / "checkpoints").iterdir())
    assert kept == ["checkpoint_1", "checkpoint_2"], kept
    accelerator.load_state()  # the latest
    assert hooks[-1] == ("load", f"{out_dir}/project/checkpoints/checkpoint_2"), hooks[-1]

    accelerator.save_model(model, f"{out_dir}/model")
    accelerator.wait_for_everyone()
    saved = load_file(f"{out_dir}/model/model.safetensors")
    reference = build_model("tiny-llama", seed=0).state_dict()
    assert sorted(saved) == sorted(k for k in reference if k != "lm_head.weight" or k in saved)
    for name, tensor in saved.items():
        assert torch.equal(tensor, reference[name]), name

    partitioned = build_model("tiny-llama", seed=0)
    next(partitioned.parameters()).ds_id = 0  # what deepspeed.zero.Init leaves: a (0,) placeholder
    try:
        accelerator.prepare_model(partitioned)
    except ConfigError as err:
        assert "built under DeepSpeed's zero.Init" in str(err), err
    else:
        raise AssertionError("a model ZeRO-3 partitioned at construction was accepted")

    # accelerate's parallelism_config is read by mtk (tests/distributed/test_fsdp.py trains with it); what mtk cannot
    # do with it is one line on every rank before any group is built
    # (its cp_size is mtk's CP: 4 processes at TP 2 x CP 2 leave DP 1, which dp_shard_size 2 cannot shard)
    try:
        Accelerator(parallelism_config=ParallelismConfig(tp_size=2, dp_shard_size=2, cp_size=2))
    except ConfigError as err:
        assert "dp_replicate_size 1 x dp_shard_size 2 must be the data-parallel size 1" in str(err), err
    else:
        raise AssertionError("FSDP2 over 2 DP ranks was accepted at DP 1")
    return True


def test_accelerate_api_at_tp2_dp2(tmp_path):
    assert run_distributed(_check_api, world_size=4, args=(str(tmp_path),)) == [True] * 4


def _accumulation_from_the_launcher(rank: int, world_size: int) -> list:
    import contextlib
    import io
    import os

    import pytest

    from mtk import Accelerator, ConfigError, ParallelConfig

    os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = (
        "3"  # as `accelerate launch --gradient_accumulation_steps 3`
    )
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        explicit = Accelerator(gradient_accumulation_steps=2, parallel_config=ParallelConfig(tp_size=2))
    seen = [explicit.gradient_accumulation_steps, os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"]]
    seen.append(Accelerator(parallel_config=ParallelConfig(tp_size=2)).gradient_accumulation_steps)
    for malformed in ("two", "\u00b2"):  # (a superscript two passes str.isdigit, not int())
        os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = malformed
        with pytest.raises(ConfigError, match=f"ACCELERATE_GRADIENT_ACCUMULATION_STEPS={malformed!r} must be a"):
            Accelerator(parallel_config=ParallelConfig(tp_size=2))
    return [*seen, said.getvalue() if rank == 0 else None]


def test_an_explicit_accumulation_beats_the_launchers_variable_with_one_line():
    """accelerate takes ACCELERATE_GRADIENT_ACCUMULATION_STEPS over the constructor's value without a word (a script's
    --grad_accum silently lost); mtk's explicit value wins and says so, the variable applies when nothing is given,
    and a malformed one is one line."""
    (explicit, kept, implicit, said), _ = run_distributed(_accumulation_from_the_launcher, world_size=2)
    assert (explicit, kept, implicit) == (2, "3", 3)
    assert "mtk: gradient_accumulation_steps=2 (explicit) overrides ACCELERATE_GRADIENT_ACCUMULATION_STEPS=3" in said


def _mixed_precision_in_capitals(rank: int, world_size: int) -> list:
    import contextlib
    import io
    import os

    import torch

    from mtk import Accelerator, ParallelConfig

    os.environ["ACCELERATE_MIXED_PRECISION"] = "BF16"
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        accelerator = Accelerator(parallel_config=ParallelConfig(tp_size=2))
    with accelerator.autocast():
        dtype = torch.nn.Linear(4, 4)(torch.ones(1, 4)).dtype
    # the Trainer passes TrainingArguments.mixed_precision, the variable's text, as the argument
    argument = Accelerator(mixed_precision="BF16", parallel_config=ParallelConfig(tp_size=2)).mixed_precision
    return [accelerator.mixed_precision, str(dtype), argument, said.getvalue() if rank == 0 else None]


def test_a_mixed_precision_variable_in_capitals_is_read_as_accelerate_reads_its_argument():
    """accelerate lower-cases ``mixed_precision=`` but compares ACCELERATE_MIXED_PRECISION as written: ``BF16`` trained
    in fp32 without a word. mtk reads it as ``bf16``, says so, and the matmuls run in bf16."""
    (precision, dtype, argument, said), _ = run_distributed(_mixed_precision_in_capitals, world_size=2)
    assert (precision, dtype, argument) == ("bf16", "torch.bfloat16", "bf16")
    assert "mtk: ACCELERATE_MIXED_PRECISION=BF16 read as bf16" in said


def _optimizer_updates(rank: int, world_size: int) -> list:
    import contextlib
    import io

    import pytest
    import torch
    from transformers.optimization import Adafactor

    from mtk import Accelerator, ConfigError, ParallelConfig
    from mtk.models import build_model
    from mtk.parallel.parameters import is_tensor_parallel

    accelerator = Accelerator(parallel_config=ParallelConfig(tp_size=2))
    model = accelerator.prepare(build_model("tiny-llama"))
    for whole_tensor in (
        torch.optim.Adafactor(model.parameters()),
        Adafactor(model.parameters(), lr=1e-3, relative_step=False),
    ):
        with pytest.raises(ConfigError, match="Adafactor computes its update from statistics of each whole tensor"):
            accelerator.prepare(whole_tensor)
    # prepared holding replicated parameters alone, then given TP shards: refused when they are added, and left out
    replicated = [p for p in model.parameters() if not is_tensor_parallel(p)]
    split = [p for p in model.parameters() if is_tensor_parallel(p)]
    later = accelerator.prepare(torch.optim.Adafactor(replicated))
    with pytest.raises(ConfigError, match="Adafactor computes its update from statistics of each whole tensor"):
        later.add_param_group({"params": split})
    assert len(later.param_groups) == 1
    later.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})  # a replicated one is fine

    class Mine(torch.optim.SGD):  # a class mtk does not know: said, not refused
        pass

    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        accelerator.prepare(torch.optim.AdamW(model.parameters()))
        accelerator.prepare(Mine(model.parameters(), lr=0.1))
    return said.getvalue().splitlines() if rank == 0 else []


def test_an_optimizer_reading_whole_tensors_is_refused_next_to_tensor_parallelism():
    """Adafactor (torch's and transformers', the Trainer's --optim adafactor) computes factored moments and an update
    RMS per tensor: on TP shards it trains differently from one process (1e-2 on the weights after 3 steps), so it is
    one line, also when the shards come by ``add_param_group`` after ``prepare``; AdamW passes without a word, an
    optimizer mtk does not know is named in one line."""
    said = run_distributed(_optimizer_updates, world_size=2)[0]
    assert said == [
        "mtk: Mine updates split parameters shard by shard; that equals one process only if its update treats every "
        "element on its own (as AdamW and SGD do)"
    ]


def _summed_once_per_step(rank: int, world_size: int) -> int:
    """tiny-qwen3 at TP 2 with sequence parallelism: its per-head q/k norms' and its norms' gradients are summed over
    TP once per step. Three ways of accumulating two micro-batches all give one process's gradients: accelerate's
    ``accumulate`` (one sync, after the second backward), two ``backward`` calls that each sync before one step (the
    second arrives on top of a summed gradient), and the same after ``zero_grad(set_to_none=False)``."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from mtk import Accelerator, ParallelConfig, RunSettings
    from mtk.models import builtin_config
    from mtk.parallel.parameters import param_info
    from mtk.testing import assert_close_rel

    accelerator = Accelerator(
        parallel_config=ParallelConfig(tp_size=2),
        run_settings=RunSettings(sequence_parallel=True),
        gradient_accumulation_steps=2,
    )
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(builtin_config("tiny-qwen3")).float()
    model = accelerator.prepare(copy.deepcopy(reference))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    whole = (reference(input_ids=ids[:1], labels=ids[:1]).loss + reference(input_ids=ids[1:], labels=ids[1:]).loss) / 2
    whole.backward()
    wanted = {name: p.grad for name, p in reference.named_parameters()}
    marked = [(n, p, param_info(p)) for n, p in model.named_parameters()]
    summed = [(n, p) for n, p, info in marked if info.tp_shared or info.sequence_parallel]
    assert any(param_info(p).tp_shared for _, p in summed) and any(param_info(p).sequence_parallel for _, p in summed)
    for way in ("accumulate", "backward twice", "zeroed in place"):
        for row in (0, 1):
            context = accelerator.accumulate(model) if way == "accumulate" else contextlib.nullcontext()
            with context:
                accelerator.backward(model(input_ids=ids[row : row + 1], labels=ids[row : row + 1]).loss)
            assert accelerator.sync_gradients == (way != "accumulate" or row == 1)  # elsewhere each backward syncs
        for name, param in summed:
            assert_close_rel(param.grad, wanted[name], f"{way}: {name} gradient")
        model.zero_grad(set_to_none=way != "backward twice")  # the third way starts from zeros held in place
    return len(summed)


def test_gradients_summed_over_tp_once_per_step_count_each_micro_batch_once():
    counts = run_distributed(_summed_once_per_step, world_size=2)
    assert counts[0] == counts[1] > 0


def _peft_before_prepare(rank: int, world_size: int) -> None:
    import pytest
    from peft import LoraConfig, get_peft_model

    from mtk import Accelerator, ConfigError, ParallelConfig
    from mtk.models import build_model

    accelerator = Accelerator(parallel_config=ParallelConfig(tp_size=world_size))
    model = get_peft_model(build_model("tiny-llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ConfigError, match=r"convert the base model first.*mtk\.lora\.get_peft_model"):
        accelerator.prepare(model)


def test_a_model_given_to_peft_before_prepare_is_one_line_naming_the_order_that_works():
    """PEFT's adapters wrap the layers the conversion replaces: one line naming mtk.lora.get_peft_model on the
    converted model ("q_proj is a Linear; a linear rule needs nn.Linear or Conv1D" before)."""
    run_distributed(_peft_before_prepare, world_size=2)
