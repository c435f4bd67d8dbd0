"""mtk's expert parallelism under DeepSpeed ZeRO 0, 1 and 2: DeepSpeed's own MoE path does the experts' side of DP.

mtk spreads transformers' experts over the EP group itself (:mod:`mtk.parallel.expert_parallel`): each rank holds
``1/ep`` of every MoE layer's experts, and those gradients must be averaged over the ranks holding the same experts
(the expert replicas), not over DP. DeepSpeed does exactly that for what it calls MoE parameters: a parameter with
``allreduce = False`` and a ``group_name`` is reduced (at ZeRO 1/2 reduce-scattered and its optimizer state
partitioned) over the expert-data-parallel group registered under that name in ``deepspeed.utils.groups``, divided
by the data-parallel size like the dense ones, in optimizer param groups of its own (``"moe": True``); its gradient
norm counts each expert once. mtk registers its own EP and expert-replica groups there (its layout: EP carved out of
DP x CP, docs/moe.md), marks the spread experts, and names the optimizer's param groups as DeepSpeed's split wants.

DeepSpeed turns that path on when the model holds one of its own ``MoE`` modules; mtk's experts modules are
transformers', so while ``deepspeed.initialize`` builds the engine its test for one also accepts a module mtk spread
(:func:`spread_experts_seen_as_moe`). DeepSpeed's native MoE does not run at ZeRO-3 (the engine refuses it), nor next
to its AutoEP (its ``expert_parallel`` section), nor with ZeRO++'s quantized gradients: each is one line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mtk.errors import ConfigError
from mtk.parallel.expert_parallel import EXPERT_PARALLEL_ATTRIBUTE
from mtk.parallel.parameters import is_expert_parallel
from mtk.parallel.state import ParallelState

__all__ = [
    "check_deepspeed_experts",
    "deepspeed_expert_group",
    "follow_param_group_split",
    "named_param_groups",
    "prepare_experts_for_deepspeed",
    "split_client_optimizer",
    "spread_experts_seen_as_moe",
]


def deepspeed_expert_group(parallel: ParallelState) -> str:
    """The name the experts' groups are registered under: DeepSpeed's own spelling for an EP size."""
    return f"ep_size_{parallel.ep_size}"


def check_deepspeed_experts(config: dict[str, Any], parallel: ParallelState, where: str) -> None:
    """What DeepSpeed's MoE path cannot take next to mtk's EP, one line each (nothing to check at EP 1)."""
    if parallel.ep_size == 1:
        return
    what = f"expert parallelism (ep = {parallel.ep_size}) under DeepSpeed"
    if parallel.cp_size > 1:
        raise ConfigError(
            f"{what} does not run with context parallelism (cp = {parallel.cp_size}) yet; use a megatron_lm_config "
            "YAML (DDP), or EP without CP"
        )
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if stage == 3:
        raise ConfigError(
            f"{what} runs at ZeRO 0, 1 or 2 ({where} asks for stage 3, where DeepSpeed's engine refuses MoE "
            "parameters); use stage 2, or FSDP2 next to EP (a parallelism_config with dp_shard_size, docs/moe.md)"
        )
    if isinstance(zero, dict) and zero.get("zero_quantized_gradients"):
        raise ConfigError(f'{what} does not take ZeRO++\'s "zero_quantized_gradients"; remove it from {where}')
    autoep = config.get("expert_parallel")
    if isinstance(autoep, dict) and autoep.get("enabled", False):
        raise ConfigError(
            f"{what} spreads the experts itself; {where}'s \"expert_parallel\" section turns on DeepSpeed's AutoEP, "
            "which would replace them again: remove the section (or set the EP size to 1 to use AutoEP alone)"
        )


def prepare_experts_for_deepspeed(model: nn.Module, parallel: ParallelState) -> str | None:
    """Register mtk's EP and expert-replica groups with DeepSpeed and mark the spread experts as its MoE parameters;
    the group name, or ``None`` where nothing is spread (EP 1, or this pipeline stage has no MoE layer)."""
    spread = [p for p in model.parameters() if is_expert_parallel(p)]
    if parallel.ep_size == 1 or not spread:
        return None
    if not any(p.requires_grad for p in spread):  # DeepSpeed's MoE path needs a param group of them to train
        raise ConfigError(
            f"expert parallelism (ep = {parallel.ep_size}) under DeepSpeed trains the experts or their LoRA factors: "
            "with the experts frozen and no factor of theirs (LoRA on the linears only) DeepSpeed has no MoE "
            "parameter group and would broadcast one rank's experts over the others; add the expert tensors to LoRA "
            "(--lora_target_parameters mlp.experts.gate_up_proj,mlp.experts.down_proj), train at EP with accelerate "
            "(accelerate_configs/ep2.yaml), or set the EP size to 1"
        )
    from deepspeed.utils import groups

    name = deepspeed_expert_group(parallel)
    for registry, ranks, group in (
        (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS, parallel.ep_group),
        (groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS, parallel.expert_replica_group),
    ):
        registry[name] = group
        ranks[name] = dist.get_process_group_ranks(group)
    for param in model.parameters():
        if is_expert_parallel(param):
            param.allreduce = False  # type: ignore[attr-defined]  # DeepSpeed's is_moe_param
            param.group_name = name  # type: ignore[attr-defined]
    return name


def named_param_groups(parameters: Any) -> list[dict[str, Any]]:
    """``model_parameters`` as DeepSpeed's MoE split wants them: dicts, each with a ``name``."""
    items = list(parameters)
    if items and not isinstance(items[0], dict):
        items = [{"params": items}]
    return [{**group, "name": group.get("name", f"mtk_group_{i}")} for i, group in enumerate(items)]


def split_client_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """A torch optimizer's param groups split as DeepSpeed's MoE path wants (the experts of each group in groups of
    their own, ``"moe": True``, same hyperparameters), in place, before its first step. Which group each came from is
    kept for the LR schedulers built on the optimizer before (:func:`follow_param_group_split`)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    groups = named_param_groups(optimizer.param_groups)
    before = len(groups)  # (DeepSpeed's split appends to the list it is given)
    for index, group in enumerate(groups):
        group[_SOURCE] = index  # copied into the experts' groups made from it
    split = [g for g in split_params_into_different_moe_groups_for_optimizer(groups) if g["params"]]
    setattr(optimizer, _SPLIT, (before, [g.pop(_SOURCE) for g in split]))
    optimizer.param_groups = split


_SOURCE = "mtk_split_from"  # (transient) a param group's index before the split
_SPLIT = "_mtk_moe_split"  # on a split optimizer: (groups before, each group's source index)
_FOLLOWED = "_mtk_follows_split"  # on a scheduler whose lists follow the split already
# a torch LR scheduler's per-group lists (LambdaLR's lr_lambdas, CyclicLR's max_lrs, ReduceLROnPlateau's min_lrs)
_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "max_lrs", "min_lrs")


def _per_group(name: str, value: Any, groups: int) -> bool:
    """Whether a scheduler's attribute looks like a list of one number (or function) per param group."""
    if not isinstance(value, list) or len(value) != groups or name in ("milestones", "_milestones"):
        return False
    return all(callable(v) or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in value)


def follow_param_group_split(scheduler: Any) -> None:
    """Make a torch LR scheduler built on an optimizer before :func:`split_client_optimizer` split it step every
    group: its per-group lists take each new group's source entry (each experts' group schedules as the group it
    came from). A scheduler that keeps another per-group list is one line. Nothing to do for any other scheduler."""
    split = getattr(getattr(scheduler, "optimizer", None), _SPLIT, None)
    if split is None:
        return
    before, sources = split
    if sources == list(range(before)):
        return
    for one in [scheduler, *getattr(scheduler, "_schedulers", [])]:  # SequentialLR's and ChainedScheduler's
        if getattr(one, _FOLLOWED, False):
            continue
        for name in _PER_GROUP:
            values = getattr(one, name, None)
            if isinstance(values, list) and len(values) == before:
                setattr(one, name, [values[source] for source in sources])
        setattr(one, _FOLLOWED, True)
        left = [k for k, v in vars(one).items() if _per_group(k, v, before) and len(sources) != before]
        if left:
            raise ConfigError(
                f"{type(one).__name__} keeps a list per param group ({', '.join(left)}) that mtk does not know; under "
                "DeepSpeed with expert parallelism the experts take param groups of their own: use a scheduler "
                "from torch.optim.lr_scheduler or transformers' get_scheduler, or the DeepSpeed JSON's scheduler"
            )


@contextlib.contextmanager
def spread_experts_seen_as_moe() -> Iterator[None]:
    """While DeepSpeed builds its engine: its test for a DeepSpeed ``MoE`` module also accepts a module whose
    experts mtk spread, so the engine reduces, partitions and broadcasts their parameters over their groups."""
    import deepspeed.runtime.engine as engine

    native = engine.MoE

    class _SpreadOrNative(type):
        def __instancecheck__(cls, obj: object) -> bool:
            return isinstance(obj, native) or hasattr(obj, EXPERT_PARALLEL_ATTRIBUTE)

    class SpreadExperts(metaclass=_SpreadOrNative):
        """A module mtk spread over EP, or DeepSpeed's own MoE."""

    engine.MoE = SpreadExperts
    try:
        yield
    finally:
        engine.MoE = native
