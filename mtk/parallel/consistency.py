"""The ranks of one model replica compute on the same batch, dropout stream and weights, whatever the user seeded.

Tensor and pipeline parallelism split one model over the model-parallel group (TP x PP): every rank of
it must see the same batch, draw the same masks in the replicated regions and start from the same
weights, or training is silently wrong (a user who seeds per process, as accelerate documents with
``set_seed(seed, device_specific=True)``, gets different ones on every rank). Megatron broadcasts each
batch from the TP source rank (``broadcast_data``) so that it need not rely on the ranks agreeing;
mtk does the same over the model-parallel group, from its source rank (TP rank 0 of the first stage):

- the batch: :func:`broadcast_batches` yields the source's batch, whatever each rank's loader drew. Per
  batch: 2 broadcasts (structure, shapes, dtypes and non-tensor entries, pickled) + 1 per tensor dtype
  (token ids, mask and labels: 1).
- the replicated-region RNG and the TP stream's seed: :func:`agree_rng` gives every rank the source's CPU
  (and device) generator state, hence its ``initial_seed``. Once, before conversion: 1 broadcast.
- the weights (materialized): :func:`agree_weights`, a fingerprint all-reduce; the source's tensors are
  broadcast where they differ. Once: 1 all-reduce, and a broadcast per differing tensor.
- the loss: :func:`check_same_loss`, one line when the ranks backpropagate different losses. Per
  backward: 1 all-reduce of 2 numbers.

When the ranks already agree, nothing changes but the cost.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mtk.errors import TrainingError
from mtk.parallel.comm import Group, group_size
from mtk.parallel.random import _get_state, _set_state

__all__ = [
    "BroadcastBatches",
    "agree_rng",
    "agree_weights",
    "broadcast_batch",
    "broadcast_batches",
    "check_same_inputs",
    "check_same_loss",
    "same_inputs_hook",
]


@dataclass(frozen=True)
class _Slot:
    """Where a tensor of the source's batch goes: its index, shape, dtype, and whether it was on the device."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_device: bool


class _EndOfData:
    """What the source sends when its loader is exhausted."""


def _map(obj: Any, fn: Callable[[Any], Any], leaf: type) -> Any:
    """``obj`` with every ``leaf`` inside dicts, lists and tuples replaced by ``fn(leaf)`` (containers copied)."""
    if isinstance(obj, leaf):
        return fn(obj)
    if isinstance(obj, Mapping):
        out = copy.copy(obj)  # keeps the type (dict, OrderedDict, BatchEncoding, ...)
        for key, value in obj.items():
            out[key] = _map(value, fn, leaf)  # type: ignore[index]
        return out
    if isinstance(obj, list):
        return [_map(v, fn, leaf) for v in obj]
    if isinstance(obj, tuple):
        values = [_map(v, fn, leaf) for v in obj]
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
    return obj


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype  # not every backend broadcasts bool


def broadcast_batch(batch: Any, group: Group, src: int, device: torch.device) -> Any:
    """The source rank's ``batch`` on every rank of ``group`` (``src``: its global rank).

    ``batch``: tensors, possibly inside dicts (``BatchEncoding`` included), lists and tuples, and any
    picklable values. The structure, shapes, dtypes and non-tensor values travel first (pickled: two
    broadcasts), then one flat buffer per dtype on ``device``. The source gets its own
    ``batch`` back untouched; a receiver gets tensors on ``device`` (or on the CPU where the source's were).
    """
    if group_size(group) == 1:
        return batch
    is_src = dist.get_rank() == src
    tensors: list[torch.Tensor] = []

    def slot(tensor: torch.Tensor) -> _Slot:
        tensors.append(tensor)
        on_device = tensor.device.type == device.type
        return _Slot(len(tensors) - 1, tuple(tensor.shape), tensor.dtype, on_device)

    skeleton = _broadcast_object(_map(batch, slot, torch.Tensor) if is_src else None, group, src, device)
    slots: list[_Slot] = []
    _map(skeleton, slots.append, _Slot)
    received: dict[int, torch.Tensor] = {}
    for dtype in dict.fromkeys(_wire_dtype(s.dtype) for s in slots):  # in order of first appearance
        group_slots = [s for s in slots if _wire_dtype(s.dtype) == dtype]
        sizes = [int(torch.Size(s.shape).numel()) for s in group_slots]
        if is_src:
            buffer = torch.cat([tensors[s.index].detach().to(device, dtype).reshape(-1) for s in group_slots])
        else:
            buffer = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.broadcast(buffer, src=src, group=group)
        for s, flat in zip(group_slots, buffer.split(sizes)):
            tensor = flat.view(s.shape).to(s.dtype)
            received[s.index] = tensor if s.on_device else tensor.cpu()
    if is_src:
        return batch
    return _map(skeleton, lambda s: received[s.index], _Slot)


def _broadcast_object(obj: Any, group: Group, src: int, device: torch.device) -> Any:
    """``obj`` of the source, pickled: its length, then its bytes (what ``broadcast_object_list`` does, through
    the public ``broadcast`` so that :func:`~mtk.parallel.collective_count.count_collectives` sees both)."""
    is_src = dist.get_rank() == src
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if is_src else None
    length = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.long, device=device)
    dist.broadcast(length, src=src, group=group)
    data = payload.to(device) if payload is not None else torch.empty(int(length), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src, group=group)
    return obj if is_src else pickle.loads(data.cpu().numpy().tobytes())


def broadcast_batches(own: Iterator[Any], group: Group, src: int, device: torch.device) -> Iterator[Any]:
    """The source rank's batches, drawn in step with this rank's own iterator ``own`` (which is still consumed,
    batch for batch). Ends when the source's ends; a rank whose iterator ends at another batch is one line."""
    while True:
        batch = next(own, _EndOfData())
        agreed = broadcast_batch(batch, group, src, device)
        if isinstance(agreed, _EndOfData) != isinstance(batch, _EndOfData):
            raise TrainingError(
                f"the DataLoader yields a different number of batches on rank {dist.get_rank()} than on rank {src}, "
                "ranks of one model replica: give every rank of a replica the same dataset"
            )
        if isinstance(agreed, _EndOfData):
            return
        yield agreed


class BroadcastBatches:
    """An iterable of batches (a prepared DataLoader) whose every batch is the model-parallel source rank's.

    Every rank still iterates its own loader (its epoch position, accelerate's end-of-data flags and
    ``set_epoch`` stay what they were); what it yields is replaced by the source's. A loader that runs out
    on one rank and not on the source is one line. Attributes (``set_epoch``, ``batch_size``, ...) are the
    wrapped loader's; ``loader`` is the wrapped one.
    """

    def __init__(self, loader: Iterable, group: Group, src: int, device: torch.device) -> None:
        self.loader, self.group, self.src, self.device = loader, group, src, device

    def __iter__(self) -> Iterator[Any]:
        return broadcast_batches(iter(self.loader), self.group, self.src, self.device)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


def agree_rng(group: Group, src: int, device: torch.device) -> None:
    """Give every rank of ``group`` the source's default generators: the CPU one (and with it
    ``torch.initial_seed()``, which the TP stream derives from) and ``device``'s when it is not the CPU.

    Replicated-region dropout draws from them, so they must be equal over TP (and, for the data-loading
    draws, over PP too). One broadcast of the generator states.
    """
    if group_size(group) == 1:
        return
    states = [torch.get_rng_state()] + ([_get_state(device)] if device.type != "cpu" else [])
    sizes = [s.numel() for s in states]
    buffer = torch.cat(states).to(device)
    dist.broadcast(buffer, src=src, group=group)
    received = [part.cpu() for part in buffer.split(sizes)]
    torch.set_rng_state(received[0])
    if device.type != "cpu":
        _set_state(device, received[1])


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    out = []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) not in seen and tensor.device.type != "meta":
            seen.add(id(tensor))
            out.append((name, tensor))
    return out


def agree_weights(model: nn.Module, group: Group, src: int, device: torch.device) -> list[str]:
    """Make ``model``'s materialized parameters and buffers equal to the source rank's; returns the names
    that differed (an empty list when every rank already held the same model).

    The check is cheap: each tensor's fp64 sum and sum of squares, one all-reduce (MAX of the values and of
    their negatives) over ``group``. Only the tensors whose fingerprints differ are broadcast from ``src``:
    a model initialized from a per-rank seed becomes the source's, as DDP makes replicas rank 0's.
    """
    if group_size(group) == 1:
        return []
    named = _named_tensors(model)
    if not named:
        return []
    with torch.no_grad():
        prints = torch.stack(
            [
                torch.stack([(v := t.double()).sum(), torch.linalg.vector_norm(v)]).to(device)  # ints too
                for _, t in named
            ]
        )  # [tensors, 2]
        both = torch.cat([prints, -prints])  # MAX of both: the maximum and minus the minimum
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        high, low = both[: len(named)], -both[len(named) :]
        differs = (high != low).any(dim=1).tolist()
        for (_, tensor), differ in zip(named, differs):
            if differ:
                on_device = tensor.to(device)
                dist.broadcast(on_device, src=src, group=group)
                tensor.copy_(on_device)
    return [name for (name, _), differ in zip(named, differs) if differ]


def check_same_loss(loss: torch.Tensor, group: Group, device: torch.device) -> None:
    """One line when the ranks of ``group`` (one model replica) backpropagate different losses.

    They compute on the same batch and weights, so their losses are bitwise equal; a difference means
    something outside the model differs per rank (labels taken from a batch mtk did not broadcast, a
    random draw from a per-rank generator). One all-reduce of two numbers.
    """
    if group_size(group) == 1:
        return
    value = loss.detach().reshape(-1)[:1].to(device, torch.float64)
    both = torch.cat([value, -value])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = both[0].item(), -both[1].item()
    if high != low and not (high != high and low != low):  # NaN on every rank is the same loss
        raise TrainingError(
            f"the ranks of one model replica backpropagate different losses ({low!r} to {high!r}): compute "
            "the loss from the model's outputs and a batch of a DataLoader passed through accelerator.prepare "
            "(mtk gives every rank of a replica the same batch), not from per-rank data or random draws"
        )


def _fingerprint(obj: Any) -> torch.Tensor:
    """Four fp64 numbers of every tensor inside ``obj`` (dicts, lists, tuples): element count, sum, sum of
    squares and a position-weighted sum (so a permuted or shifted batch differs too). A fixed length whatever
    the batch, so ranks that disagree still meet in one all-reduce of the same size."""
    tensors: list[torch.Tensor] = []
    _map(obj, tensors.append, torch.Tensor)
    total = torch.zeros(4, dtype=torch.float64)
    with torch.no_grad():
        for tensor in tensors:
            flat = tensor.detach().reshape(-1).double().cpu()  # [n]
            weights = torch.arange(flat.numel(), dtype=torch.float64) % 1009 + 1  # [n]
            total += torch.stack([torch.tensor(float(flat.numel())), flat.sum(), flat.square().sum(), flat @ weights])
    return total


def check_same_inputs(args: Any, kwargs: Any, group: Group, device: torch.device) -> None:
    """One line when the ranks of ``group`` (one model replica) call the model on different inputs.

    :func:`check_same_loss` cannot see this under tensor parallelism: the vocab-parallel embedding and
    cross-entropy all-reduce over the TP group, so ranks fed different token ids mix them into one loss that
    every rank then shares (training silently on neither batch). A batch of a loader passed through
    ``prepare`` is broadcast (:func:`broadcast_batches`) and always passes. One all-reduce of 8 numbers per
    forward, called as a forward pre-hook of the prepared model.
    """
    if group_size(group) == 1:
        return
    prints = torch.stack([_fingerprint(args), _fingerprint(kwargs)]).reshape(-1).to(device)  # [8]
    both = torch.cat([prints, -prints])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = both[: prints.numel()], -both[prints.numel() :]
    differs = (high != low) & ~(high.isnan() & low.isnan())
    if bool(differs.any()):
        raise TrainingError(
            "the ranks of one model replica call the model on different inputs: pass batches of a DataLoader "
            "prepared with accelerator.prepare (mtk gives every rank of a replica its source rank's batch), not "
            "per-rank data or random draws; tensor parallelism would otherwise mix the ranks' inputs silently"
        )


def same_inputs_hook(group: Group, device: torch.device) -> Callable[..., None]:
    """A ``register_forward_pre_hook(..., with_kwargs=True)`` hook running :func:`check_same_inputs`."""

    def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
        check_same_inputs(args, kwargs, group, device)

    return hook
