"""mtk's EP under DeepSpeed: what DeepSpeed's MoE path cannot take is one line, and the param groups it wants split
out of a torch optimizer leave the LR schedulers built on it stepping every group as the group it came from."""

import pytest
import torch

from mtk.config import ConfigError
from mtk.integrations.deepspeed_experts import (
    check_deepspeed_experts,
    follow_param_group_split,
    named_param_groups,
    split_client_optimizer,
)


class _Layout:
    ep_size, cp_size = 2, 1


@pytest.mark.parametrize(
    ("config", "said"),
    [
        ({"zero_optimization": {"stage": 3}}, "runs at ZeRO 0, 1 or 2 (ds.json asks for stage 3"),
        ({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}}, '"zero_quantized_gradients"'),
        ({"expert_parallel": {"enabled": True, "autoep_size": 2}}, "turns on DeepSpeed's AutoEP"),
    ],
)
def test_what_deepspeeds_moe_path_cannot_take_is_one_line(config, said):
    with pytest.raises(ConfigError, match=said.replace("(", r"\(")):
        check_deepspeed_experts(config, _Layout(), "ds.json")


def test_expert_parallelism_next_to_context_parallelism_under_deepspeed_is_one_line():
    with_cp = type("WithCP", (), {"ep_size": 2, "cp_size": 2})()
    with pytest.raises(ConfigError, match=r"does not run with context parallelism \(cp = 2\) yet"):
        check_deepspeed_experts({"zero_optimization": {"stage": 2}}, with_cp, "ds.json")


def test_nothing_to_check_without_expert_parallelism_or_with_what_runs():
    one = type("One", (), {"ep_size": 1, "cp_size": 1})()
    check_deepspeed_experts({"zero_optimization": {"stage": 3}}, one, "ds.json")
    check_deepspeed_experts({"zero_optimization": {"stage": 2}, "expert_parallel": {"enabled": False}}, _Layout(), "x")


def _experts_and_dense():
    dense, experts, bias = (torch.nn.Parameter(torch.zeros(n)) for n in (3, 4, 2))
    experts.allreduce = False  # DeepSpeed's MoE parameter marks (what prepare_experts_for_deepspeed sets)
    experts.group_name = "ep_size_2"
    return dense, experts, bias


def test_a_client_optimizer_is_split_and_its_schedulers_follow():
    """Two groups (decay, no decay) become three (the experts of the first in a group of their own, "moe": True,
    same hyperparameters): LambdaLR's per-group lambdas and SequentialLR's inner schedulers' lists follow."""
    dense, experts, bias = _experts_and_dense()
    optimizer = torch.optim.AdamW([{"params": [dense, experts], "weight_decay": 0.1}, {"params": [bias]}], lr=1.0)
    halving = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: 0.5**s, lambda s: 1.0])
    warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=2)
    chained = torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, halving], milestones=[2])
    split_client_optimizer(optimizer)
    groups = optimizer.param_groups
    assert [len(g["params"]) for g in groups] == [1, 1, 1] and groups[2].get("moe")
    assert groups[2]["params"] == [experts]
    assert groups[2]["weight_decay"] == 0.1 and groups[2]["name"] == "ep_size_2"
    for scheduler in (halving, chained):
        follow_param_group_split(scheduler)
        follow_param_group_split(scheduler)  # once only
    assert len(halving.lr_lambdas) == len(halving.base_lrs) == 3 and halving.lr_lambdas[2] is halving.lr_lambdas[0]
    assert len(warm.base_lrs) == 3
    optimizer.step()
    chained.step()
    assert groups[2]["lr"] == groups[0]["lr"]


def test_a_scheduler_with_a_per_group_list_mtk_does_not_know_is_one_line():
    dense, experts, bias = _experts_and_dense()
    optimizer = torch.optim.SGD([{"params": [dense, experts]}, {"params": [bias]}], lr=1.0)

    class Mine(torch.optim.lr_scheduler.LambdaLR):
        def __init__(self, optimizer):
            self.floors = [0.0, 0.0]  # one per group
            super().__init__(optimizer, lambda s: 1.0)

    mine = Mine(optimizer)
    split_client_optimizer(optimizer)
    with pytest.raises(ConfigError, match=r"Mine keeps a list per param group \(floors\)"):
        follow_param_group_split(mine)


def test_model_parameters_are_named_for_the_split():
    dense, experts, _ = _experts_and_dense()
    assert [g["name"] for g in named_param_groups([dense, experts])] == ["mtk_group_0"]
    assert named_param_groups([{"params": [dense], "name": "mine"}, {"params": [experts]}])[1]["name"] == "mtk_group_1"


def test_frozen_spread_experts_under_deepspeed_are_one_line():
    """LoRA on the linears only at EP: DeepSpeed has no MoE parameter group to train and would broadcast the frozen
    experts of one rank over its DP group. (With the experts' factors, spread with them, it trains them:
    tests/e2e/test_expert_parallel.py.)"""
    from mtk.integrations.deepspeed_experts import prepare_experts_for_deepspeed
    from mtk.parallel.parameters import set_param_info

    model = torch.nn.Linear(2, 2)
    for param in model.parameters():
        set_param_info(param, expert_parallel=True)
        param.requires_grad_(False)
    with pytest.raises(ConfigError, match=r"LoRA on the linears only\) DeepSpeed has no MoE parameter group"):
        prepare_experts_for_deepspeed(model, _Layout())
