"""Stop a run cleanly when asked: save a checkpoint at the next step boundary, then exit.

Schedulers (SLURM, Kubernetes) send SIGTERM some time before they kill a job; a user presses Ctrl-C
(SIGINT). Megatron's exit-signal handler answers by saving and exiting; :class:`ExitSignal` does the
same for mtk's scripts. The handler only records the signal (nothing else is safe inside a handler);
the training loop calls :meth:`ExitSignal.requested` once per optimizer step, which agrees over all
ranks (a signal may reach only some of them), and then saves and leaves the loop. A second SIGINT gets
the default behaviour (a second Ctrl-C stops at once); a second SIGTERM does not, because one
preemption often delivers several (SLURM signals every process of the step and torchrun forwards its
own; a dying launcher adds the parent-death signal), and the save must not die of them.

Workers also ask the kernel for SIGTERM when their launcher dies (``PR_SET_PDEATHSIG`` on Linux), so a
launcher killed with SIGKILL does not leave them training and writing checkpoints on their own: they
save at the next step boundary and exit.
"""

from __future__ import annotations

import ctypes
import signal
import sys
from types import FrameType

import torch
import torch.distributed as dist

__all__ = ["ExitSignal"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # no prctl: the launcher's own shutdown is all there is
        pass


class ExitSignal:
    """SIGTERM/SIGINT (and the launcher's death) as a request to save and exit at a step boundary."""

    def __init__(self, device: torch.device | str = "cpu", signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.device = device
        self.received: int | None = None
        self._previous = {sig: signal.signal(sig, self._record) for sig in signals}
        _die_with_parent()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signum
        if signum == signal.SIGINT:  # the next Ctrl-C acts as it would have
            signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT, signal.default_int_handler))

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else "a signal on another rank"

    def requested(self) -> bool:
        """Whether any rank received a signal. Collective over all ranks: call it once per step on each."""
        flag = torch.tensor([1.0 if self.received else 0.0], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
