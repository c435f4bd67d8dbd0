"""Point-to-point transfers between adjacent pipeline stages over the PP group.

Sends are non-blocking (``isend``; the tensor is kept alive until :meth:`StageLink.flush`), receives
block when their data is needed; the engine posts each one a pass early (:meth:`StageLink.post`,
Megatron's overlapped P2P), so the transfer runs while the stage computes. With that rule any schedule
in which every receive is matched by a send issued earlier in the sender's own order cannot deadlock,
in whichever order the two neighbours reach them. Activations
flow forward to the next stage, their gradients backward to the previous one; per (sender,
receiver) pair there is one direction of one kind, so messages need no tags. Every TP rank of a
stage talks to the same TP rank of its neighbour.

The interleaved schedule wraps around: the last rank's chunk ``c`` feeds the first rank's chunk
``c + 1``, so the ring closes and with ``pp = 2`` both kinds share a pair. Messages then match by
order alone (as NCCL's do); :func:`~mtk.pipeline.schedules.simulate` checks, before a schedule runs,
that every receive meets the very message it waits for.

Scatter-gather (Megatron's P2P optimization): the activations and gradients crossing a stage boundary are
the same on every TP rank of a stage, so with TP > 1 each TP rank sends only its 1/TP slice of the
flattened tensor and the receiving stage all-gathers the slices over its TP group (NVLink) — the link
between stages, often the slow one, carries 1/TP of the bytes. A tensor TP does not divide goes whole.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from mtk.parallel.comm import all_gather
from mtk.parallel.state import ParallelState

__all__ = ["Posted", "StageLink"]


class Posted:
    """A receive posted before its data is needed: :meth:`StageLink.wait` returns the tensor."""

    def __init__(self, work: dist.Work, buffer: torch.Tensor, shape: tuple[int, ...], scattered: bool) -> None:
        self.work, self.buffer, self.shape, self.scattered = work, buffer, shape, scattered


class StageLink:
    """This rank's sends and receives to the previous and next pipeline stage.

    Attributes:
        wait_s: seconds spent blocked in receives (idle: the pipeline bubble, plus transfer time).
    """

    def __init__(self, parallel: ParallelState, wrap_around: bool = False) -> None:
        self.group = parallel.pp_group
        ranks, stage = parallel.pp_ranks, parallel.pp_rank
        self.prev_rank = ranks[stage - 1] if stage > 0 or wrap_around else None
        self.next_rank = ranks[(stage + 1) % len(ranks)] if stage < len(ranks) - 1 or wrap_around else None
        self.tp_group, self.tp_rank, self.tp_size = parallel.tp_group, parallel.tp_rank, parallel.tp_size
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self.wait_s = 0.0

    def _scattered(self, numel: int) -> bool:
        return self.tp_size > 1 and numel % self.tp_size == 0

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.detach().contiguous()
        if self._scattered(tensor.numel()):  # this TP rank's slice; the receiver gathers the rest
            tensor = tensor.reshape(-1).chunk(self.tp_size)[self.tp_rank].clone()  # [numel / tp]
        work = dist.isend(tensor, dst=dst, group=self.group)
        assert work is not None  # a member of the group always gets a handle
        self._pending.append((work, tensor))

    def wait(self, posted: Posted) -> torch.Tensor:
        """The tensor of a posted receive, once it has arrived (the time blocked counts as waiting)."""
        start = time.perf_counter()
        posted.work.wait()
        self.wait_s += time.perf_counter() - start
        if posted.scattered:  # every TP rank received its slice: gather the whole over the TP group
            return all_gather(posted.buffer, self.tp_group, dim=0).reshape(posted.shape)
        return posted.buffer

    def post(self, forward: bool, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Posted:
        """Start receiving the next activation (``forward``) or gradient; receives complete in the order posted."""
        src = self.prev_rank if forward else self.next_rank
        assert src is not None, "the first stage receives nothing forward, the last nothing backward"
        numel = math.prod(shape)
        scattered = self._scattered(numel)
        buffer = torch.empty(numel // self.tp_size if scattered else shape, dtype=dtype, device=device)
        work = dist.irecv(buffer, src=src, group=self.group)
        assert work is not None
        return Posted(work, buffer, shape, scattered)

    def send_forward(self, activation: torch.Tensor) -> None:
        assert self.next_rank is not None, "the last stage sends nothing forward"
        self._send(activation, self.next_rank)

    def send_backward(self, grad: torch.Tensor) -> None:
        assert self.prev_rank is not None, "the first stage sends nothing backward"
        self._send(grad, self.prev_rank)

    def flush(self) -> None:
        """Wait until every send has left (end of a schedule); frees the kept tensors."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
