"""Tensor parallelism inside MoE experts stored as 3D tensors (transformers 5: ``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``), the ``moe_tp_experts`` style of HF's tp plans.

Every expert is an MLP, split as one: its gate and up halves by columns (each half on its own), its down
projection by rows. HF's own experts module keeps running on the local shards (its per-expert ``linear``
calls take any width); each rank's output is then a partial sum over its slice of the intermediate width:

    y = sum_e w_e * down_e(act(gate_e x) * up_e x) = sum_r sum_e w_e * down_e,r(act(gate_e,r x) * up_e,r x)

so one all-reduce after the experts gives the exact output. In backward the input's gradient and the routing
weights' gradient are partial sums too (each rank sees its share of every expert's output): both pass through
``copy_to_tp`` on the way in (identity forward, all-reduce backward). The router itself stays replicated, so
every rank routes every token the same way, and its load-balancing loss is unchanged.

The parameters are cut in place; the module records their specs (``mtk_shard_specs``), which loading,
checkpoints, export and gathering read as they read a :class:`~mtk.parallel.layers.ShardedModule`'s.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mtk.errors import UnsupportedModelError
from mtk.parallel.comm import Group, copy_to_tp, group_rank, group_size, reduce_from_tp
from mtk.parallel.parameters import mark_tensor_parallel
from mtk.parallel.sharding import ShardSpec, take_shard

__all__ = ["SPECS_ATTRIBUTE", "TP_GROUP_ATTRIBUTE", "split_experts"]

SPECS_ATTRIBUTE = "mtk_shard_specs"  # {parameter name: (full shape, ShardSpec)} of a module cut in place
TP_GROUP_ATTRIBUTE = "mtk_tp_group"  # the TP group an experts module's tensors were cut over


def _specs(module: Any, intermediate: int, tp_size: int, rank: int) -> dict[str, tuple[tuple[int, ...], ShardSpec]]:
    gate_up, down = module.gate_up_proj, module.down_proj  # [E, 2I, H] and [E, H, I] (or transposed)
    per = intermediate // tp_size
    mine = (rank * per, (rank + 1) * per)
    transposed = getattr(module, "is_transposed", None)  # (transformers' experts say; shapes alone are ambiguous
    if transposed is None:  # where the hidden size is twice the expert width)
        transposed = gate_up.shape[1] != 2 * intermediate
    up_dim, down_dim = (2, 1) if transposed else (1, 2)
    halves = (mine, (intermediate + mine[0], intermediate + mine[1]))  # this rank's gate rows, then its up rows
    return {
        "gate_up_proj": (tuple(gate_up.shape), ShardSpec(dim=up_dim, ranges=halves, local_size=2 * per)),
        "down_proj": (tuple(down.shape), ShardSpec(dim=down_dim, ranges=(mine,))),
    }


def _enter(tp_group: Group):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, index, weights = (list(args) + [None] * 3)[:3]
        hidden = kwargs.pop("hidden_states", hidden)
        index = kwargs.pop("top_k_index", index)
        weights = kwargs.pop("top_k_weights", weights)
        return (copy_to_tp(hidden, tp_group), index, copy_to_tp(weights, tp_group)), kwargs

    return hook


def split_experts(module: Any, tp_group: Group, intermediate: int | None = None) -> None:
    """Cut ``module``'s experts to this rank's slice of the intermediate width, in place (meta tensors stay on
    the meta device: a loader fills them slice by slice)."""
    tp, rank = group_size(tp_group), group_rank(tp_group)
    if not all(hasattr(module, name) for name in ("gate_up_proj", "down_proj")):
        raise UnsupportedModelError(f"{type(module).__name__}: experts without gate_up_proj/down_proj tensors")
    if any(getattr(module, name, None) is not None for name in ("gate_up_proj_bias", "down_proj_bias")):
        raise UnsupportedModelError(f"{type(module).__name__}: experts with biases are not split yet")
    size = int(getattr(module, "intermediate_dim", None) or intermediate or module.down_proj.shape[-1])
    if size % tp:
        raise UnsupportedModelError(f"{type(module).__name__}: expert width {size} is not divisible by tp = {tp}")
    specs = _specs(module, size, tp, rank)
    for name, (shape, spec) in specs.items():
        old: Any = getattr(module, name)
        assert spec.dim is not None  # both tensors are split
        if old.device.type == "meta":
            local = list(shape)
            local[spec.dim] = spec.local_size or spec.taken()
            data = torch.empty(local, device="meta", dtype=old.dtype)
        else:
            data = take_shard(spec, shape, old.detach().__getitem__).clone()
        param = nn.Parameter(data, requires_grad=old.requires_grad)
        mark_tensor_parallel(param, partition_dim=spec.dim)
        setattr(module, name, param)
    setattr(module, SPECS_ATTRIBUTE, specs)
    setattr(module, TP_GROUP_ATTRIBUTE, tp_group)
    if hasattr(module, "intermediate_dim"):
        module.intermediate_dim = size // tp
    if tp > 1:
        module.register_forward_pre_hook(_enter(tp_group), with_kwargs=True)
        module.register_forward_hook(lambda m, args, out: reduce_from_tp(out, tp_group))
