"""What ``mtk.Accelerator`` reduces and gathers: over the data-parallel replicas, not every process.

The TP and PP ranks of one replica hold the same metrics and see the same batch, so accelerate's
process-wide ``reduce``/``gather``/``split_between_processes`` would count each replica tp x pp times
(or feed one split model different inputs). Only the breakpoint trigger spans every process.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from accelerate.state import PartialState
from accelerate.utils import recursively_apply

from mtk.errors import ConfigError
from mtk.parallel.comm import all_reduce, group_size
from mtk.parallel.state import ParallelState

if TYPE_CHECKING:  # the mixin is checked as part of accelerate's Accelerator
    from accelerate import Accelerator as _Host
else:
    _Host = object

__all__ = ["DataParallelCollectives"]

# accelerate's splitting logic, which reads only num_processes, process_index and device from its state
_split_between = contextmanager(PartialState.split_between_processes.__wrapped__)


class DataParallelCollectives(_Host):
    """Mixin for :class:`mtk.Accelerator`: accelerate's metric collectives over ``self.parallel.dp_group``."""

    parallel: ParallelState
    flag_tensor: torch.Tensor | None  # accelerate's trigger flag

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        """Reduce over the data-parallel group (TP/PP ranks of one replica hold the same values): accelerate's
        ``mean``, ``sum``, ``max`` and ``none`` (a sum, as accelerate's is). ``scale`` is applied by accelerate on
        XLA only, and ignored elsewhere; mtk runs on no XLA, so another scale is one line, not dropped."""
        if reduction not in ("sum", "mean", "max", "none"):
            raise ConfigError(f"reduce: reduction={reduction!r} is not one of 'mean', 'sum', 'max', 'none'")
        if scale != 1.0:
            raise ConfigError(
                f"reduce: scale={scale} is applied by accelerate on XLA only (elsewhere it is ignored); multiply the "
                "reduced value instead"
            )
        dp_size, group = self.parallel.dp_size, self.parallel.dp_group
        op = dist.ReduceOp.MAX if reduction == "max" else dist.ReduceOp.SUM

        def _reduce(t: torch.Tensor) -> torch.Tensor:
            out = all_reduce(t.clone(), group, op=op) if dp_size > 1 else t.clone()
            return out / dp_size if reduction == "mean" else out

        return recursively_apply(_reduce, tensor, error_on_other_type=True)

    def check_trigger(self) -> bool:
        """accelerate's breakpoint trigger, summed over every process (not only the DP group): a
        ``set_trigger`` on any rank must stop its TP and PP peers too."""
        if self.flag_tensor is None:
            self.flag_tensor = torch.tensor(0, device=self.device)
        flag = self.flag_tensor.clone()
        if dist.is_initialized():
            dist.all_reduce(flag)  # the default group: every process
        if flag.item() >= 1:
            self.flag_tensor = torch.tensor(0, device=self.device)
            return True
        return False

    @contextmanager
    def split_between_processes(self, inputs, apply_padding: bool = False):
        """accelerate's split, over the data-parallel replicas: the TP and PP ranks of one replica get
        the same piece (a split model must see one input on all its ranks)."""
        replicas = SimpleNamespace(
            num_processes=self.parallel.dp_size, process_index=self.parallel.dp_rank, device=self.device
        )
        with _split_between(replicas, inputs, apply_padding) as piece:
            yield piece

    def gather(self, tensor):
        """Concatenate along dim 0 over the data-parallel group (same shapes on every replica)."""
        group = self.parallel.dp_group

        def _gather(t: torch.Tensor) -> torch.Tensor:
            if group_size(group) == 1:
                return t
            t = t.contiguous() if t.dim() else t.reshape(1)
            pieces = [torch.empty_like(t) for _ in range(group_size(group))]
            dist.all_gather(pieces, t, group=group)
            return torch.cat(pieces, dim=0)

        return recursively_apply(_gather, tensor, error_on_other_type=True)

    def _gather_objects(self, obj: list) -> list:
        """accelerate's ``gather_object`` over the data-parallel group: the replicas' lists, concatenated."""
        group = self.parallel.dp_group
        if group_size(group) == 1:
            return obj
        pieces: list = [None] * group_size(group)
        dist.all_gather_object(pieces, obj, group=group)
        return [item for piece in pieces for item in piece]

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        """accelerate's ``gather_for_metrics`` over DP: tensors with :meth:`gather`, anything else (or
        ``use_gather_object=True``) with ``all_gather_object``; the samples the last batch repeated to
        even out the replicas are dropped."""
        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
        except TypeError:
            use_gather_object = True
        data = self._gather_objects(input_data) if use_gather_object else self.gather(input_data)
        remainder = self.gradient_state.remainder
        loader = self.gradient_state.active_dataloader
        if remainder == -1 and self.gradient_state.end_of_dataloader and getattr(loader, "_mtk_stream", False):
            if self.parallel.dp_size > 1:  # (accelerate says so too, in its words)
                self.print(
                    "mtk: gather_for_metrics: the loader's dataset has no length (a stream read in worker "
                    "processes), so its last batch's repeats cannot be told from its rows: they are returned"
                )
        if not self.gradient_state.end_of_dataloader or remainder <= 0:
            return data
        if use_gather_object:
            return data[:remainder]
        return recursively_apply(lambda t: t[:remainder] if t.dim() else t, data)
