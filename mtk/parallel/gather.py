"""Full (unsharded) tensors of a tensor-parallel model, gathered tensor by tensor over the TP group.

Every rank of a TP group holds equally shaped shards (even splits, equal vocabulary padding), so
one ``all_gather`` per tensor brings all pieces; each rank's :class:`ShardSpec` says where its piece
goes. Gathering one tensor at a time keeps the extra memory to a single full tensor.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from mtk.parallel.comm import Group, group_size
from mtk.parallel.layers import ShardedModule
from mtk.parallel.sharding import REPLICATED, ShardSpec, merge_shards

__all__ = ["full_shape_and_spec", "gather_full_tensor", "iter_full_tensors"]


def full_shape_and_spec(model: nn.Module, name: str) -> tuple[tuple[int, ...], ShardSpec]:
    """Full shape and this rank's spec of parameter ``name`` (replicated when its module is not sharded)."""
    module_name, _, param_name = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    tensor = getattr(module, param_name)
    if isinstance(module, ShardedModule):
        return module.full_shape(param_name), module.shard_spec(param_name)
    return tuple(tensor.shape), REPLICATED


def gather_full_tensor(
    local: torch.Tensor, spec: ShardSpec, full_shape: tuple[int, ...], tp_group: Group
) -> torch.Tensor:
    """The full tensor from every TP rank's ``local`` piece (collective over ``tp_group``)."""
    local = local.detach().contiguous()
    size = group_size(tp_group)
    if spec.is_replicated:
        return local.clone()
    if size == 1:
        return merge_shards([(local, spec)], full_shape)  # drops vocabulary padding
    pieces = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(pieces, local, group=tp_group)
    specs: list[ShardSpec | None] = [None] * size
    dist.all_gather_object(specs, spec, group=tp_group)
    return merge_shards(list(zip(pieces, specs)), full_shape)


def iter_full_tensors(model: nn.Module, tp_group: Group, grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for every parameter (or its gradient), HF names, no duplicates.

    Collective: every TP rank must iterate to the end together.
    """
    for name, param in model.named_parameters():
        tensor = param.grad if grads else param
        if tensor is None:
            raise ValueError(f"{name} has no gradient to gather; run backward first")
        shape, spec = full_shape_and_spec(model, name)
        yield name, gather_full_tensor(tensor, spec, shape, tp_group)
