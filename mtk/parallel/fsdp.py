"""Parameters sharded over data parallelism with torch's FSDP2 (``fully_shard``), next to mtk's TP.

mtk's tensor parallelism splits each weight over the TP group as a plain tensor (its shard spec says which part);
FSDP2 then splits *that* tensor again, along dim 0, over the data-parallel ranks of its TP rank: model state per
rank falls to ``1/(tp·dp)``. Every module HF names in ``_no_split_modules`` (the decoder layer: what accelerate's
FSDP auto-wrap picks) is one FSDP unit, gathered for its forward and backward and freed after; the root unit holds
the rest (embeddings, final norm, a tied head with its embedding). Gradients are reduce-scattered (averaged over
DP, as DDP averages them), so nothing else in the step changes. HSDP (``dp_replicate × dp_shard``) shards within
each ``dp_shard`` group and all-reduces across replicas: FSDP2 on a 2-D mesh of the DP ranks.

The replaced parameters are ``DTensor``\\ s on that mesh; :func:`local` is the piece this rank holds (what a
checkpoint saves: :mod:`mtk.parallel.pieces`), and :func:`full_local` the whole TP shard (collective over DP),
which is what a state dict gathers.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from mtk.errors import ConfigError
from mtk.parallel.parameters import copy_param_info, is_expert_parallel
from mtk.parallel.pieces import Piece
from mtk.parallel.state import ParallelState, new_group

__all__ = [
    "ShardingSettings",
    "copy_into",
    "counted_here",
    "data_parallel_mesh",
    "full_local",
    "held_elements",
    "is_sharded",
    "local",
    "module_class",
    "piece_of",
    "reshard",
    "shard_like",
    "shard_over_data_parallel",
    "sharded_modules",
]


@dataclass(frozen=True)
class ShardingSettings:
    """How the data-parallel ranks share parameters (accelerate's ``ParallelismConfig`` names).

    ``dp_shard_size`` ranks split each parameter; ``dp_replicate_size`` groups of them hold copies (HSDP);
    their product is the data-parallel size. ``reshard_after_forward``: free a unit's gathered parameters after
    its forward (gathered again for backward: less memory, one more all-gather), as FSDP2's default.
    ``unit_classes``: the module classes that are one unit each (accelerate's ``fsdp_transformer_layer_cls_to_wrap``);
    empty: those HF lists in ``_no_split_modules``.
    """

    dp_shard_size: int
    dp_replicate_size: int = 1
    reshard_after_forward: bool = True
    unit_classes: tuple[str, ...] = ()

    def check(self, dp_size: int) -> None:
        if self.dp_shard_size * self.dp_replicate_size != dp_size:
            raise ConfigError(
                f"parallelism_config: dp_replicate_size {self.dp_replicate_size} x dp_shard_size "
                f"{self.dp_shard_size} must be the data-parallel size {dp_size} (processes / (tp x cp x pp)); set "
                f"them so that their product is {dp_size}"
            )


def data_parallel_mesh(parallel: ParallelState, settings: ShardingSettings) -> DeviceMesh:
    """This rank's DP x CP replica ranks as FSDP2's mesh: 1-D ``(dp_shard,)``, or 2-D ``(dp_replicate, dp_shard)``
    for HSDP; with context parallelism the CP ranks, which hold the same weights, shard them too (``dp_shard``
    spans ``dp_shard_size x cp`` ranks, accelerate's ``dp_shard_cp``). Collective over the world (every rank creates
    every HSDP subgroup, in the same order)."""
    device_type = parallel.device.type
    if parallel.replica_group is None:
        raise ConfigError("FSDP2 needs a process group: launch several processes (accelerate launch, torchrun)")
    if settings.dp_replicate_size == 1:
        return DeviceMesh.from_group(parallel.replica_group, device_type, mesh_dim_names=("dp_shard",))
    shard, replicate = settings.dp_shard_size * parallel.cp_size, settings.dp_replicate_size
    mine: dict[str, Any] = {}
    for ranks in parallel.layout.groups("replica"):  # index d * cp + c, d = replica * dp_shard + position
        grid = torch.tensor(ranks).reshape(replicate, shard)
        for row in grid.tolist():
            group = new_group(row, parallel.device)
            if parallel.rank in row:
                mine["shard"], mine["grid"] = group, grid
        for column in grid.t().tolist():
            group = new_group(column, parallel.device)
            if parallel.rank in column:
                mine["replicate"] = group
    return DeviceMesh.from_group(
        [mine["replicate"], mine["shard"]], device_type, mesh=mine["grid"], mesh_dim_names=("dp_replicate", "dp_shard")
    )


def sharded_modules(model: nn.Module, unit_classes: tuple[str, ...] = ()) -> list[nn.Module]:
    """The FSDP units below the root: modules of the ``unit_classes`` or, by default, whose class HF lists in
    ``_no_split_modules`` (the decoder layers)."""
    names = set(unit_classes)
    if not names:
        for module in model.modules():
            names.update(getattr(module, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in names and m is not model]  # outermost first
    missing = sorted(set(unit_classes) - {type(m).__name__ for m in units})
    if missing:
        raise ConfigError(
            f"fsdp_transformer_layer_cls_to_wrap names {missing}, which this model does not have; name its decoder "
            f"layer class, or leave the key out"
        )
    return units


def shard_over_data_parallel(
    model: nn.Module, mesh: DeviceMesh, settings: ShardingSettings, *, decoder: nn.Module | None = None
) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """``fully_shard`` the decoder layers, then ``decoder`` (a pipeline stage's HF decoder, which the stages before
    the last call without the model around it: its embeddings and norm must be a unit of their own), then the
    root, over ``mesh``; returns ``(old, new)`` parameter pairs (FSDP2 replaces every parameter with a ``DTensor``
    one: optimizers built before must be re-pointed).

    mtk's records of each parameter (its TP split, sequence-parallel and tie flags) move to its replacement.
    Parameters stay in their dtype (fp32 master weights): accelerate's mixed precision autocasts the forward, as
    without FSDP.
    """
    before = dict(model.named_parameters(remove_duplicate=False))
    # experts spread over EP are this rank's alone within its EP group: FSDP2 leaves them whole (not sharded, not
    # reduced), and the Accelerator reduces them over the ranks holding the same experts, as without FSDP2
    experts = {p for p in model.parameters() if is_expert_parallel(p)}
    ignored: dict[str, Any] = {"ignored_params": experts} if experts else {}  # (fully_shard takes it from torch 2.7)
    if experts and "ignored_params" not in inspect.signature(fully_shard).parameters:
        raise ConfigError(f"expert parallelism with FSDP2 needs torch >= 2.7 (this is {torch.__version__})")
    # innermost first (FSDP2 leaves a unit's already sharded children to them): the named classes, nested or not,
    # then the decoder around the layers, then the root
    units = [*reversed(sharded_modules(model, settings.unit_classes)), *([decoder] if decoder is not None else [])]
    for module in units:
        fully_shard(module, mesh=mesh, reshard_after_forward=settings.reshard_after_forward, **ignored)
    # the root left to FSDP2's default (None): kept gathered from its forward to its backward, which follows at once
    root_reshard = None if settings.reshard_after_forward else False
    fully_shard(model, mesh=mesh, reshard_after_forward=root_reshard, **ignored)
    pairs = []
    for name, param in model.named_parameters(remove_duplicate=False):
        old = before[name]
        copy_param_info(old, param)
        pairs.append((old, param))
    return pairs


def reshard(model: nn.Module) -> None:
    """Every FSDP2 unit of ``model`` back to its sharded parameters. A unit stays gathered after a forward with no
    backward behind it (an evaluation: the root always, every unit with ``reshard_after_forward=False``), and
    then its registered parameters are the gathered tensors, not the ones the optimizer steps: what reads the
    model's parameters as state (a checkpoint, a state dict) reshards first. A no-op without FSDP2."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def module_class(module: nn.Module) -> type:
    """``module``'s own class: FSDP2 swaps a unit's class for a subclass of it (``FSDPLlamaForCausalLM``), which
    is no class transformers knows (a checkpoint records the model's, export builds it)."""
    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))


def is_sharded(tensor: torch.Tensor | None) -> bool:
    """Whether ``tensor`` is split over data parallelism (an FSDP2 parameter, its gradient or optimizer state)."""
    return isinstance(tensor, DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The piece of ``tensor`` this rank holds (itself when it is not sharded over DP); shares its storage."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_local(tensor: torch.Tensor) -> torch.Tensor:
    """The whole TP shard of ``tensor`` (collective over the DP mesh for a sharded one; itself otherwise)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` (a whole TP shard, the same on every DP rank) cut as ``like`` is cut: a ``DTensor`` on its mesh,
    or ``full`` itself when ``like`` is not sharded. No communication: each rank takes its own piece."""
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


@torch.no_grad()
def copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Set ``param`` from ``full``, its whole TP shard: this rank's piece of it where FSDP2 splits ``param``."""
    if isinstance(param, DTensor):
        param.to_local().copy_(cast(DTensor, shard_like(full, param)).to_local())
    else:
        param.copy_(full)


def piece_of(model: nn.Module) -> Piece | None:
    """Where this rank's pieces of ``model``'s FSDP2 parameters sit; ``None`` when nothing is split over DP."""
    for param in model.parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            replica = mesh.get_local_rank("dp_replicate") if mesh.ndim == 2 else 0
            return Piece(mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1), writes=replica == 0)
    return None


def counted_here(tensor: torch.Tensor, dp_rank: int) -> bool:
    """Whether this rank's piece of ``tensor`` enters a sum over the model once: a DP-replicated tensor on DP rank
    0 only; a DP-split one on every rank of its shard group, in the first replica (HSDP)."""
    if not isinstance(tensor, DTensor):
        return dp_rank == 0
    mesh = tensor.device_mesh
    return mesh.ndim == 1 or mesh.get_local_rank("dp_replicate") == 0


def held_elements(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, int]:
    """Model-state elements this rank holds: its pieces of the parameters and of the optimizer state (moments;
    scalars such as Adam's ``step`` not counted). What sharding claims are checked against: a TP shard is
    ``1/tp`` of a split weight, FSDP2 keeps ``1/dp_shard`` of that, the distributed optimizer ``1/dp`` of the state.
    """
    reshard(model)  # counted as held between steps, not gathered by a last evaluation
    parameters = sum(local(p).numel() for p in model.parameters())
    state = sum(
        local(t).numel()
        for optimizer in optimizers
        for fields in getattr(optimizer, "optimizer", optimizer).state.values()
        for t in fields.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    return {"parameters": parameters, "optimizer_state": state}
