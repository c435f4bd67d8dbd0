"""ParallelState in real processes: the groups torch.distributed built are the layout's, and DeepSpeed
accepts the object as its ``mpu``."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mtk.config import ParallelConfig
from mtk.parallel import ColumnParallelLinear, Layout, ParallelState, RowParallelLinear
from mtk.testing import run_distributed


def _members(group) -> list[int]:
    """Global ranks of a live group, found by communicating over it (not by asking the layout)."""
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, dist.get_rank(), group=group)
    return sorted(gathered)


def _state_report(rank: int, world_size: int, tp: int, pp: int) -> dict:
    os.environ.update(MEGATRON_LM_TP_DEGREE=str(tp), MEGATRON_LM_PP_DEGREE=str(pp))
    state = ParallelState.from_env()
    assert state.config == ParallelConfig(tp_size=tp, pp_size=pp)
    report = {
        "coords": (state.tp_rank, state.dp_rank, state.pp_rank),
        "tp": _members(state.get_tensor_model_parallel_group()),
        "dp": _members(state.get_data_parallel_group()),
        "pp": _members(state.get_pipeline_model_parallel_group()),
        "mp": _members(state.get_model_parallel_group()),
        "embedding": _members(state.embedding_group) if state.embedding_group is not None else [],
        "mpu": {
            "tp_rank": state.get_tensor_model_parallel_rank(),
            "tp_size": state.get_tensor_model_parallel_world_size(),
            "tp_src": state.get_tensor_model_parallel_src_rank(),
            "dp_rank": state.get_data_parallel_rank(),
            "dp_size": state.get_data_parallel_world_size(),
            "dp_ranks": state.get_data_parallel_group_ranks(),
            "pp_rank": state.get_pipeline_model_parallel_rank(),
            "pp_size": state.get_pipe_parallel_world_size(),
            "mp_rank": state.get_model_parallel_rank(),
            "mp_size": state.get_model_parallel_world_size(),
        },
        "first_last": (state.is_first_stage, state.is_last_stage),
        "device": str(state.device),
    }
    # A TP all-reduce only mixes ranks of one TP group.
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=state.tp_group)
    report["tp_sum"] = value.item()
    return report


@pytest.mark.parametrize("world,tp,pp", [(8, 2, 2), (4, 2, 1)])
def test_groups_match_the_layout(world, tp, pp):
    layout = Layout(world_size=world, tp_size=tp, pp_size=pp)
    reports = run_distributed(_state_report, world_size=world, args=(tp, pp))
    for rank, rep in enumerate(reports):
        c = layout.coords(rank)
        assert rep["coords"] == (c.tp_rank, c.dp_rank, c.pp_rank)
        for kind in ("tp", "dp", "pp", "mp", "embedding"):
            assert rep[kind] == sorted(layout.group_of(kind, rank)), (rank, kind)
        assert rep["tp_sum"] == sum(layout.group_of("tp", rank))
        mpu = rep["mpu"]
        assert (mpu["tp_rank"], mpu["tp_size"], mpu["tp_src"]) == (c.tp_rank, tp, layout.group_of("tp", rank)[0])
        assert (mpu["dp_rank"], mpu["dp_size"], mpu["dp_ranks"]) == (
            c.dp_rank,
            layout.dp_size,
            layout.group_of("dp", rank),
        )
        assert (mpu["pp_rank"], mpu["pp_size"]) == (c.pp_rank, pp)
        assert mpu["mp_size"] == tp * pp and layout.group_of("mp", rank)[mpu["mp_rank"]] == rank
        assert rep["first_last"] == (c.pp_rank == 0, c.pp_rank == pp - 1)
        assert rep["device"] == "cpu"


def _deepspeed_zero_over_dp(rank: int, world_size: int) -> dict:
    import deepspeed

    state = ParallelState.build(tp_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(
        ColumnParallelLinear(8, 16, tp_group=state.tp_group), RowParallelLinear(16, 8, tp_group=state.tp_group)
    )
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
    }
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, mpu=state
    )
    loss = engine(torch.randn(2, 8)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return {
        "dp_world": engine.dp_world_size,
        "mp_world": engine.mp_world_size,
        "partition_count": list(optimizer.partition_count),
        "zero_group": deepspeed.comm.get_all_ranks_from_group(optimizer.dp_process_group),
    }


def test_deepspeed_accepts_state_as_mpu_and_shards_over_dp_only():
    layout = Layout(world_size=4, tp_size=2)
    reports = run_distributed(_deepspeed_zero_over_dp, world_size=4, timeout=600)
    for rank, rep in enumerate(reports):
        assert rep["dp_world"] == 2 and rep["mp_world"] == 2
        assert rep["partition_count"] == [2]
        assert rep["zero_group"] == layout.group_of("dp", rank)


def _single_process(rank: int, world_size: int) -> None:
    state = ParallelState.build(tp_size=1)
    assert state.world_size == 1 and state.tp_size == 1 and state.dp_size == 1


def test_single_process_without_process_group():
    state = ParallelState.build()
    assert (state.tp_group, state.dp_group) == (None, None)
    assert state.get_model_parallel_rank() == 0 and state.get_data_parallel_world_size() == 1
    run_distributed(_single_process, world_size=1)


def test_validate_divisible_lists_valid_sizes():
    state = ParallelState(Layout(world_size=4, tp_size=4), rank=0, groups={}, device=torch.device("cpu"))
    with pytest.raises(
        ValueError, match=r"num_key_value_heads = 6 is not divisible by tp = 4; valid tp sizes .*\[1, 2, 3, 6\]"
    ):
        state.validate_divisible("num_key_value_heads", 6)
