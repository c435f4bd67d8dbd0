"""fp16 loss scaling under tensor parallelism.

``GradScaler`` skips a step when a gradient overflowed. With the model split over ranks, each rank
sees only its shards: one rank may find an inf its peers do not, and if it alone skipped the step the
replicated weights would diverge. :class:`TPGradScaler` takes the max of the overflow flags over the
model-parallel group after unscaling, so every rank makes the same decision (as Megatron does). Under the
distributed optimizer every gradient is unscaled and checked, not only those of the parameters a rank updates.
Under expert parallelism a rank's experts are its alone within its EP group: the flag then spans the EP group too
(TP x PP x EP, every rank holding a part of one model; the other EP groups hold the same reduced gradients and
decide alike).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtk.parallel.comm import all_reduce
from mtk.parallel.distributed_optimizer import full_optimizer_state
from mtk.parallel.state import ParallelState

__all__ = ["TPGradScaler"]


class TPGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` whose overflow check spans the model-parallel group."""

    def __init__(self, device: str = "cuda", *, parallel: ParallelState, **kwargs) -> None:
        super().__init__(device, **kwargs)
        self.parallel = parallel

    @classmethod
    def from_scaler(cls, scaler: torch.amp.GradScaler, parallel: ParallelState) -> TPGradScaler:
        """Same settings as ``scaler`` (which accelerate built from the user's GradScalerKwargs)."""
        return cls(
            scaler._device,
            parallel=parallel,
            init_scale=scaler._init_scale,
            growth_factor=scaler._growth_factor,
            backoff_factor=scaler._backoff_factor,
            growth_interval=scaler._growth_interval,
            enabled=scaler._enabled,
        )

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        # the distributed optimizer lists only the parameters this rank updates: every gradient must still be
        # unscaled (clipping reads them all) and checked (every replica must find the same overflow)
        with full_optimizer_state([optimizer], gather=False):
            super().unscale_(optimizer)
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        for flag in found.values():
            all_reduce(flag.view(1), self.parallel.mp_group, op=dist.ReduceOp.MAX)
            if self.parallel.ep_size > 1:
                all_reduce(flag.view(1), self.parallel.ep_group, op=dist.ReduceOp.MAX)
