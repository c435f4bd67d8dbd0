"""Full (unsharded) tensors of a tensor-parallel model, gathered tensor by tensor over the TP group.

Every rank of a TP group holds equally shaped shards (even splits, equal vocabulary padding), so
one ``all_gather`` per tensor brings all pieces; each rank's :class:`ShardSpec` says where its piece
goes. Gathering one tensor at a time keeps the extra memory to a single full tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from mtk.parallel.comm import Group, group_size
from mtk.parallel.expert_parallel import is_expert_parallel, spread_layout
from mtk.parallel.experts import SPECS_ATTRIBUTE
from mtk.parallel.fsdp import full_local
from mtk.parallel.layers import ShardedModule
from mtk.parallel.parameters import param_info
from mtk.parallel.pieces import shard_shape
from mtk.parallel.sharding import REPLICATED, ShardSpec, merge_shards
from mtk.parallel.state import ParallelState

__all__ = ["full_shape_and_spec", "gather_full_tensor", "gather_state_dict", "iter_full_tensors"]


def full_shape_and_spec(model: nn.Module, name: str) -> tuple[tuple[int, ...], ShardSpec]:
    """Full shape and this rank's spec of parameter ``name`` (replicated when its module is not sharded)."""
    module_name, _, param_name = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    tensor = getattr(module, param_name)
    if isinstance(module, ShardedModule):
        return module.full_shape(param_name), module.shard_spec(param_name)
    cut_in_place = getattr(module, SPECS_ATTRIBUTE, {})  # HF modules whose tensors were cut (MoE experts)
    if param_name in cut_in_place:
        return cut_in_place[param_name]
    return shard_shape(tensor), REPLICATED  # (a ZeRO-3 parameter's own shape is empty outside a gather)


def gather_full_tensor(
    local: torch.Tensor, spec: ShardSpec, full_shape: tuple[int, ...], tp_group: Group
) -> torch.Tensor:
    """The full tensor from every TP rank's ``local`` piece (collective over ``tp_group``, and over DP for a
    piece FSDP2 splits further)."""
    local = full_local(local.detach()).contiguous()
    size = group_size(tp_group)
    if spec.is_replicated:
        return local.clone()
    if size == 1:
        return merge_shards([(local, spec)], full_shape)  # drops vocabulary padding
    pieces = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(pieces, local, group=tp_group)
    specs: list[ShardSpec | None] = [None] * size
    dist.all_gather_object(specs, spec, group=tp_group)
    return merge_shards([(piece, spec) for piece, spec in zip(pieces, specs) if spec is not None], full_shape)


def iter_full_tensors(model: nn.Module, tp_group: Group, grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for every parameter (or the gradient of every trainable one), HF names, no
    duplicates.

    Collective: every TP rank (and, for FSDP2-split parameters, every DP rank; for experts spread over EP, every
    rank of the EP group: all experts are gathered first) must iterate to the end together.
    """
    for name, param in model.named_parameters():
        if grads and not param.requires_grad:  # frozen (AFMoE's expert bias, a LoRA base): no gradient to compare
            continue
        tensor = param.grad if grads else param
        if tensor is None:
            raise ValueError(f"{name} has no gradient to gather; run backward first")
        layout = spread_layout(model, name)
        if layout is not None:
            tensor = layout.gather(tensor.detach())  # [E, ...] of this TP slice
        shape, spec = full_shape_and_spec(model, name)
        yield name, gather_full_tensor(tensor, spec, shape, tp_group)


def gather_state_dict(
    model: nn.Module,
    parallel: ParallelState,
    whole: Callable[[torch.Tensor], contextlib.AbstractContextManager] | None = None,
) -> dict[str, torch.Tensor]:
    """The whole model's state dict, full tensors under HF names, on global rank 0 (``{}`` elsewhere).

    Each stage gathers its tensors over TP one at a time; later pipeline stages then send theirs to
    rank 0 one at a time. Tied tensors stay shared, as in the HF model (a pipeline's last-stage copy
    of a tied embedding is not sent). ``whole(tensor)``: a context in which an engine that partitions
    parameters over DP holds that one whole (ZeRO-3's ``GatheredParameters([p])``), so no rank ever holds
    more than one of them gathered. Collective: every rank must call it.
    """
    main = parallel.rank == 0
    sender = parallel.tp_rank == 0 and parallel.replica_rank == 0  # one copy of each stage goes to rank 0
    full: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}  # name -> the name whose tensor it shares
    seen: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen or param_info(tensor).pipeline_duplicate:
            aliases[name] = seen.get(id(tensor)) or str(param_info(tensor).tied_to)
            continue
        seen[id(tensor)] = name
        shape, spec = full_shape_and_spec(model, name)
        layout = spread_layout(model, name) if is_expert_parallel(tensor) else None
        with whole(tensor) if whole is not None else contextlib.nullcontext():
            value = tensor.detach()  # (inside: ZeRO-3 replaces the parameter's data by the gathered tensor)
            if layout is not None:  # this rank's experts: all of them first (over EP), then over TP
                value = layout.gather(value)
            gathered = gather_full_tensor(value, spec, shape, parallel.tp_group)
        if sender:
            full[name] = gathered.cpu()
    if parallel.pp_size > 1 and sender:
        full, aliases = _collect_stages(full, aliases, parallel)
    if not main:
        return {}
    for name, target in aliases.items():
        full[name] = full[_under_prefix(target, name, full)]
    return full


def _under_prefix(target: str, name: str, full: dict[str, torch.Tensor]) -> str:
    """``target`` (a pipeline duplicate's HF name for the tensor it copies: ``transformer.wte.weight``) under the
    prefix ``name`` has in this state dict (a ``PeftModel``'s ``base_model.model.``), as gathered."""
    parts = name.split(".")
    for cut in range(len(parts)):
        key = ".".join([*parts[:cut], target])
        if key in full:
            return key
    raise KeyError(f"{name} copies {target}, which the gathered state holds under no prefix of {name}")


def _collect_stages(full: dict, aliases: dict, parallel: ParallelState) -> tuple[dict, dict]:
    """Stages 1.. send their (name, tensor) pairs to stage 0 of the same pipeline, in stage order."""
    group, first = parallel.pp_group, parallel.pp_ranks[0]
    for stage in range(1, parallel.pp_size):
        src = parallel.pp_ranks[stage]
        if parallel.rank == src:
            header: list = [[(n, tuple(t.shape), t.dtype) for n, t in full.items()], aliases]
            dist.send_object_list(header, dst=first, group=group)
            for tensor in full.values():
                dist.send(tensor.to(parallel.device).contiguous(), dst=first, group=group)
        elif parallel.rank == first:
            header = [None, None]
            dist.recv_object_list(header, src=src, group=group)
            received = {}
            for name, shape, dtype in header[0]:
                buffer = torch.empty(shape, dtype=dtype, device=parallel.device)
                dist.recv(buffer, src=src, group=group)
                received[name] = buffer.cpu()
            full, aliases = {**full, **received}, {**aliases, **header[1]}
    return full, aliases
