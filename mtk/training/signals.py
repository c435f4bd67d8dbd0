"""Stop a run cleanly when asked: save a checkpoint at the next step boundary, then exit; asked twice, stop at once.

Schedulers (SLURM, Kubernetes) send SIGTERM some time before they kill a job; a user presses Ctrl-C (SIGINT); a
terminal or ssh session that closes sends SIGHUP (whose default action ended a run started without a launcher at
once, unsaved; torchrun turns the SIGHUP it gets into SIGTERM for its workers). Megatron's exit-signal handler
answers by saving and exiting; :class:`ExitSignal` does the same for mtk's scripts. The handler only records the
signal; the training loop calls :meth:`ExitSignal.requested` once per optimizer step (and evaluation once per
batch), which agrees over all ranks (a signal may reach only some of them, or reach them at different points of a
step), so every rank stops at the same step, none is left waiting in a collective, and the run saves there.

One request often arrives more than once: a terminal's Ctrl-C or SLURM's signal reaches every process of
the job while torchrun's agent (``accelerate launch``) forwards the one it got to every worker's process
group. Signals that *arrive* within :data:`DUPLICATE_S` of the first are that same request. A signal after
that is a second request, "stop now": the rank says so in one line and dies of that signal (no traceback, no
``KeyboardInterrupt`` inside a collective), leaving at most a ``step_N.incomplete`` that the next save
removes, never a checkpoint that looks complete. torchrun answers a second Ctrl-C to the launcher by
sending its workers SIGTERM, which is such a second request.

Arrival times are taken by a watcher thread woken through :func:`signal.set_wakeup_fd` (Python's C-level
handler writes each signal's number there as it arrives): a Python handler runs only when the main thread
is back in Python, which may be seconds later (inside a collective waiting for a slow rank), and would make
one request delivered twice look like two. The same thread carries out "stop now", so it is prompt even
while the main thread waits in a collective.

A process that carried out a request ignores the signals while it ends (an ``atexit`` hook): Python's
finalization puts the default action back, under which a late delivery of that same request (0.2 s after the first,
on a machine where the save and the stop took less) killed a run that had saved, exit status 143 instead of 0.

Workers also ask the kernel for SIGTERM when their launcher dies (``PR_SET_PDEATHSIG`` on Linux), so a
launcher killed with SIGKILL does not leave them training and writing checkpoints on their own: they
save at the next step boundary and exit.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from types import FrameType

import torch
import torch.distributed as dist

__all__ = ["DUPLICATE_S", "ExitSignal"]

_PR_SET_PDEATHSIG = 1

# How far apart the deliveries of one request may arrive (the scheduler's and the launcher's forward, on a
# loaded machine); a human's second Ctrl-C after a save began comes later than this.
DUPLICATE_S = 1.0


def _die_with_parent(signum: int) -> bool:
    """Ask the kernel for ``signum`` when the parent dies (0: nothing); whether it could be asked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
    except (OSError, AttributeError):  # no prctl: the launcher's own shutdown is all there is
        return False
    return True


class ExitSignal:
    """SIGTERM/SIGINT/SIGHUP (and the launcher's death) as a request to save and exit at a step boundary; a second
    request (arriving more than ``duplicate_s`` after the first) stops the process at once, without saving.

    Build it in the main thread (Python installs signal handlers there only), once per process.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP),
        duplicate_s: float = DUPLICATE_S,
        resume_hint: str = "--resume auto continues from the newest checkpoint",
    ):
        self.device = device
        self.resume_hint = resume_hint
        signals = tuple(sig for sig in signals if signal.getsignal(sig) is not signal.SIG_IGN)  # nohup's SIGHUP stays
        self.duplicate_s = duplicate_s
        self.received: int | None = None
        read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # a full pipe drops a byte rather than block a signal handler
        self._chained = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)  # (asyncio: still its bytes)
        self._previous = {sig: signal.signal(sig, self._record) for sig in signals}
        watcher = threading.Thread(target=self._watch, args=(read, self._chained, set(signals)), daemon=True)
        watcher.start()
        # a launcher's worker: SIGTERM when the launcher dies (under a plain shell, its parent is the shell)
        self._with_parent = "LOCAL_RANK" in os.environ and _die_with_parent(signal.SIGTERM)
        atexit.register(self._ignore_while_ending)

    def restore(self) -> None:
        """Give the signals back to the handlers they had (a library's ``train()`` that returns to its caller's
        code, where a Ctrl-C should act as it did before); the watcher thread ends. In the main thread."""
        atexit.unregister(self._ignore_while_ending)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._chained)
        os.close(self._write)  # the watcher reads the end of the pipe and returns
        if self._with_parent:
            _die_with_parent(0)

    def _ignore_while_ending(self) -> None:
        """At exit, after a request: its signals are ignored from here. CPython's finalization resets every signal
        with a Python handler to the default action (and leaves an ignored one ignored), so a duplicate delivery
        arriving then would kill a run that saved and is ending as asked."""
        if self.received:
            for sig in self._previous:
                signal.signal(sig, signal.SIG_IGN)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signum  # read by requested(); the watcher decides about "stop now"

    def _watch(self, read: int, chained: int, signals: set[int]) -> None:
        """Time each signal as it arrives; one more than ``duplicate_s`` after the first means "stop now"."""
        first: float | None = None
        first_signum = 0
        while arrived := os.read(read, 64):  # b"" once restore() closed the pipe
            now = time.monotonic()
            if chained >= 0:
                with contextlib.suppress(OSError):
                    os.write(chained, arrived)
            for signum in (s for s in arrived if s in signals):
                if first is None:
                    first, first_signum = now, signum
                elif now - first > self.duplicate_s:
                    _stop_now(signum, first_signum, self.resume_hint)
        os.close(read)

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else "a signal on another rank"

    def requested(self) -> bool:
        """Whether any rank received a signal. Collective over all ranks: call it at the same points on each."""
        flag = torch.tensor([1.0 if self.received else 0.0], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _stop_now(signum: int, first_signum: int, resume_hint: str) -> None:
    """Die of ``signum`` (as an interrupted program does: the launcher and the shell see which), after one line
    from rank 0. Runs in the watcher thread, where Python cannot change a handler: libc's ``signal`` restores the
    default action (terminate the process), whatever the main thread is doing."""
    if os.environ.get("RANK", "0") == "0":
        name, first = signal.Signals(signum).name, signal.Signals(first_signum).name
        # (torchrun turns a second Ctrl-C into SIGTERM for its workers; which delivery comes first is a race)
        again = "again" if name == first else f"after {first}"
        stopped = f"stopped at once, without saving; {resume_hint}"
        line = f"mtk: {name} {again}: {stopped}\n"
        os.write(2, line.encode())
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).signal(signum, ctypes.c_void_p(0))  # SIG_DFL
        os.kill(os.getpid(), signum)
        time.sleep(1.0)  # (the signal ends the process before this returns)
    os._exit(128 + signum)  # (no libc through ctypes): exit with the shell's status for that signal
