"""Optimizer state sharded over the data-parallel group without DeepSpeed (Megatron's distributed optimizer).

ZeRO stage 1 (Rajbhandari et al., 2020): every DP replica holds the same weights and, after the gradient
reduction, the same gradients, so the update of a parameter needs doing once. Each parameter is owned by one
DP rank (the biggest first, to the least loaded rank); the user's optimizer keeps only its own parameters in
its ``param_groups`` (the same group dicts, so schedulers keep working) and therefore holds state for 1/dp of
them; after each step one all-gather per dtype gives every replica the updated weights again. Adam's update
is element-wise, so the result is bit-for-bit the unsharded one.

Gradients are still all-reduced (DDP's overlapped buckets; under PP the pipeline's coalesced reduction), as
DeepSpeed's stage 1 does, rather than reduce-scattered: the memory saved is the optimizer state's
(``(dp - 1) / dp`` of it, 12 of the 16 bytes per parameter of mixed-precision Adam at large dp).

Under expert parallelism the experts of a rank are not every replica's: they are shared only by the ranks holding
the same experts (the expert-replica group). Their owners are therefore drawn from that group, and their
all-gather runs over it; the dense parameters keep the DP x CP group (Megatron-Core's distributed optimizer keeps
an expert-data-parallel buffer beside the dense one in the same way).

Checkpoints keep mtk's layout (one optimizer file per TP x PP rank, written by DP rank 0):
:func:`full_optimizer_state` gathers the other ranks' state for the save and gives every rank the whole
state to load from, then drops what it does not own, so a checkpoint resumes and reshards with or without
the distributed optimizer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from mtk.parallel.comm import Group, all_gather, group_rank, group_size
from mtk.parallel.expert_parallel import is_expert_parallel

__all__ = ["DataParallelShards", "all_gather_rounds", "assign_owners", "full_optimizer_state", "shard_optimizer"]

_ATTRIBUTE = "mtk_dp_shards"
# Elements each rank contributes to one all-gather of updated weights (a parameter bigger than this goes
# alone): the receive buffer, DP times this, is the transient memory the distributed optimizer adds.
BUCKET_ELEMENTS = 2**22


def assign_owners(numels: list[int], dp_size: int) -> list[int]:
    """The DP rank that updates each parameter: the biggest first, each to the least loaded rank."""
    load, owners = [0] * dp_size, [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        owners[i] = min(range(dp_size), key=lambda r: (load[r], r))
        load[owners[i]] += numels[i]
    return owners


def all_gather_rounds(numels: list[int], owners: list[int], dp_size: int) -> list[list[list[int]]]:
    """Per all-gather round, per rank: indices of the parameters that rank sends (in order, at most
    ``BUCKET_ELEMENTS`` elements unless one parameter is bigger)."""
    capacity = max(BUCKET_ELEMENTS, max(numels, default=0))
    per_rank: list[list[list[int]]] = []
    for rank in range(dp_size):
        buckets: list[list[int]] = [[]]
        for i in (i for i in range(len(numels)) if owners[i] == rank):
            if buckets[-1] and sum(numels[j] for j in buckets[-1]) + numels[i] > capacity:
                buckets.append([])
            buckets[-1].append(i)
        per_rank.append(buckets)
    rounds = max(len(b) for b in per_rank)
    return [[b[i] if i < len(b) else [] for b in per_rank] for i in range(rounds)]


class _Domain:
    """Parameters held alike by every rank of ``group``, their owners among it and the all-gather rounds."""

    def __init__(self, params: list[torch.Tensor], group: Group) -> None:
        self.group, self.params = group, params
        self.size, self.rank = group_size(group), group_rank(group)
        owners = assign_owners([p.numel() for p in params], self.size)
        self.owner = {id(param): rank for param, rank in zip(params, owners)}
        self.buckets: dict[torch.dtype, list[list[list[torch.Tensor]]]] = {}
        for dtype in sorted({p.dtype for p in params}, key=str):
            same = [p for p in params if p.dtype == dtype]
            rounds = all_gather_rounds([p.numel() for p in same], [self.owner[id(p)] for p in same], self.size)
            self.buckets[dtype] = [[[same[i] for i in piece] for piece in pieces] for pieces in rounds]

    @torch.no_grad()
    def all_gather_params(self) -> None:
        """Every rank of the group receives the owners' updated parameters (nothing to do alone in the group)."""
        if self.size == 1:
            return
        for dtype, rounds in self.buckets.items():  # (none without parameters)
            device = self.params[0].device
            for pieces in rounds:  # pieces[r]: what rank r sends this round
                width = max(sum(p.numel() for p in piece) for piece in pieces)
                flat = torch.zeros(width, dtype=dtype, device=device)  # [width], padded
                mine = [p.reshape(-1) for p in pieces[self.rank]]
                if mine:
                    torch.cat(mine, out=flat[: sum(t.numel() for t in mine)])
                gathered = all_gather(flat, self.group, dim=0).view(self.size, width)  # [size, width]
                for rank, piece in enumerate(pieces):
                    if rank == self.rank:
                        continue
                    offset = 0
                    for param in piece:
                        param.copy_(gathered[rank, offset : offset + param.numel()].view_as(param))
                        offset += param.numel()


class DataParallelShards:
    """Which replica updates which parameter of one optimizer, and the all-gather after its step: the dense
    parameters over ``dp_group``, the experts spread over EP (if any) over ``expert_group``."""

    def __init__(self, optimizer: torch.optim.Optimizer, dp_group: Group, expert_group: Group = None) -> None:
        self.groups = [list(group["params"]) for group in optimizer.param_groups]  # every parameter, in order
        self.params = [param for group in self.groups for param in group]
        experts = [p for p in self.params if is_expert_parallel(p)]  # (no expert group: each rank updates its own)
        dense = [p for p in self.params if not is_expert_parallel(p)]
        self.domains = [_Domain(dense, dp_group)] + ([_Domain(experts, expert_group)] if experts else [])
        self.domain = {id(p): domain for domain in self.domains for p in domain.params}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``Optimizer.zero_grad`` over every parameter, not only the ones this rank updates."""
        for param in self.params:
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_().zero_()

    def owns(self, param: torch.Tensor) -> bool:
        domain = self.domain[id(param)]
        return domain.owner[id(param)] == domain.rank

    def shard(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep only this rank's parameters (and their state) in ``optimizer``."""
        for group, every in zip(optimizer.param_groups, self.groups):
            group["params"] = [param for param in every if self.owns(param)]
        for param in list(optimizer.state):
            if not self.owns(param):
                del optimizer.state[param]

    def unshard(self, optimizer: torch.optim.Optimizer) -> None:
        for group, every in zip(optimizer.param_groups, self.groups):
            group["params"] = list(every)

    def all_gather_params(self) -> None:
        """Every replica receives every owner's updated parameters: one all-gather per bucket round."""
        for domain in self.domains:
            domain.all_gather_params()

    def gather_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Give every rank every parameter's optimizer state (for a checkpoint), from its owner."""
        for param in self.params:
            domain = self.domain[id(param)]
            owner = domain.owner[id(param)]
            state = optimizer.state.get(param) if owner == domain.rank else None
            box = [{k: v.cpu() if torch.is_tensor(v) else v for k, v in state.items()} if state else None]
            if domain.group is not None and domain.size > 1:
                dist.broadcast_object_list(box, src=dist.get_global_rank(domain.group, owner), group=domain.group)
            if owner != domain.rank and box[0] is not None:
                device = param.device
                optimizer.state[param] = {
                    k: v.to(device) if torch.is_tensor(v) and v.dim() > 0 else v for k, v in box[0].items()
                }


def _after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    getattr(optimizer, _ATTRIBUTE).all_gather_params()


def shard_optimizer(
    optimizer: torch.optim.Optimizer, dp_group: Group, expert_group: Group = None
) -> DataParallelShards | None:
    """Shard ``optimizer``'s state over ``dp_group``, and that of experts spread over EP over ``expert_group`` (their
    replicas), in place; a no-op where both have one rank."""
    if hasattr(optimizer, _ATTRIBUTE) or (group_size(dp_group) == 1 and group_size(expert_group) == 1):
        return getattr(optimizer, _ATTRIBUTE, None)
    shards = DataParallelShards(optimizer, dp_group, expert_group)
    shards.shard(optimizer)
    setattr(optimizer, _ATTRIBUTE, shards)
    optimizer.register_step_post_hook(_after_step)
    # The optimizer's own zero_grad sees only its share: every gradient must still be cleared.
    optimizer.zero_grad = shards.zero_grad  # type: ignore[method-assign]
    return shards


@contextmanager
def full_optimizer_state(optimizers: list[torch.optim.Optimizer], gather: bool) -> Iterator[None]:
    """Inside the block every optimizer holds all its parameters; with ``gather``, also their state
    (collective over DP: every DP rank enters). Afterwards each rank keeps its own share again."""
    sharded = [(o, getattr(o, _ATTRIBUTE)) for o in optimizers if hasattr(o, _ATTRIBUTE)]
    for optimizer, shards in sharded:
        shards.unshard(optimizer)
        if gather:
            shards.gather_state(optimizer)
    try:
        yield
    finally:
        for optimizer, shards in sharded:
            shards.shard(optimizer)
