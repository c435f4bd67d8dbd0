"""Run a function in N local processes joined by a process group (gloo on CPU).

Used by the tests (through :mod:`mtk.testing`) and by commands that check a model in several
processes on one machine (``mtk verify``). Each worker gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT`` and ``OMP_NUM_THREADS=1`` (several processes share few cores). The caller
itself holds the rendezvous store, listening on a port the OS gave it, and the workers join it as clients:
a port chosen free and bound later by a worker can be taken in between (by a concurrent run, or by one of
the many outgoing connections gloo opens), which failed one CI run in a thousand tests with EADDRINUSE.
A worker's exception is re-raised in the caller with that worker's traceback; a worker
that hangs (a collective nobody else joined) is killed after ``timeout`` seconds.

The function must be importable by the workers (defined at module level), and a script calling
``run_distributed`` needs the usual ``if __name__ == "__main__":`` guard (processes are not forked from
the caller).

Start-up cost: a fresh interpreter spends seconds importing torch and transformers, and a test suite
starts hundreds of workers. With gloo (CPU) the workers therefore come from a *fork server*: one clean
process imports :data:`PRELOAD` once and forks each worker from itself, so a worker starts in
milliseconds, still a new process per call with nothing left over from the previous one. The fork
server never runs torch code, which is what makes forking it safe. Any other backend (NCCL) spawns fresh
interpreters, because a process that may have touched CUDA must not be forked. Each worker gets the
caller's environment as it is at the call (the fork server's is from when it started).
"""

from __future__ import annotations

import os
import pickle
import random
import socket
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.context import ForkServerContext, SpawnContext
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mtk.errors import WorkerKilled, process_group_start

__all__ = ["PRELOAD", "DistributedTestError", "fork_context", "free_port", "preload", "run_distributed"]

# Imported once by the fork server (gloo only, see the module docstring); a missing one is skipped.
PRELOAD = (
    "torch",
    "torch.distributed",
    "transformers",
    "accelerate",
    "peft",
    "mtk.models",
    "mtk.convert",
    "mtk.testing",
    "mtk.integrations.accelerate",  # the Accelerator most workers build: seconds of imports each, paid once here
)


_preload = list(PRELOAD)


def preload(*modules: str) -> None:
    """Have the fork server also import ``modules`` (a caller whose workers import more than :data:`PRELOAD`, e.g.
    a test suite forking whole training scripts). Only a server not yet started sees them: call it first."""
    _preload.extend(module for module in modules if module not in _preload)


def fork_context() -> ForkServerContext:
    """The fork server's multiprocessing context: its processes fork from one that imported the preload once.

    For gloo (CPU) workers; CUDA workers start as fresh interpreters (module docstring)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_preload))  # used when the server starts, i.e. on the first call
    return ctx


class DistributedTestError(AssertionError):
    """One or more workers failed or timed out; the message holds their tracebacks.

    ``errors`` holds the workers' exceptions themselves (by rank), where they could be carried over: a command
    running workers tells bad input (an allocation past this machine's memory) from a bug by them, not by parsing a
    traceback's text (:func:`mtk.errors.allocation_failure`)."""

    def __init__(self, message: str = "", errors: Mapping[int, BaseException] | None = None) -> None:
        super().__init__(message)
        self.errors: dict[int, BaseException] = dict(errors or {})


def _ephemeral_ports() -> tuple[int, int]:
    """The range the OS draws outgoing connections' and ``bind(0)``'s ports from (Linux; IANA's elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now, for a launcher (torchrun's ``--master_port``).

    Drawn at random *below* the ephemeral range: a port from ``bind(0)`` is one the OS may hand to the
    next outgoing connection before the launcher binds it (gloo opens many), which is a real EADDRINUSE
    seen in CI. Falls back to ``bind(0)`` when the range leaves no room below it.
    """
    low, _ = _ephemeral_ports()
    candidates = list(range(max(1024, low - 12288), low))
    random.shuffle(candidates)
    for port in candidates[:64]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _context(backend: str | None, fresh_interpreters: bool) -> ForkServerContext | SpawnContext:
    """Fork-server processes for gloo (fast start), fresh interpreters otherwise (CUDA-safe)."""
    if backend == "gloo" and not fresh_interpreters and "forkserver" in mp.get_all_start_methods():
        return fork_context()
    return mp.get_context("spawn")


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable,
    args: Sequence[Any],
    backend: str,
    queue,
    environ: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False)  # the caller's (module docstring)
        accelerator = torch.accelerator.current_accelerator(check_available=True) if backend != "gloo" else None
        device = None
        if accelerator is not None:  # one device per rank, named up front (NCCL would otherwise guess it)
            device = torch.device(accelerator.type, rank % max(torch.accelerator.device_count(), 1))
            torch.accelerator.set_device_index(device.index)
            # named with a device, no backend would mean the device's alone: CPU tensors keep gloo
            backend = backend or f"cpu:gloo,{device.type}:{dist.Backend.default_device_backend_map[device.type]}"
        with process_group_start():
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, device_id=device)
        result = fn(rank, world_size, *args)
        # By value: torch's queue would pass tensors as file descriptors that die with this process,
        # and the parent may read the queue only after this worker has exited.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException as err:  # report everything, including assertion errors, to the parent
        queue.put((rank, False, (traceback.format_exc(), _portable(err))))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _portable(err: BaseException) -> bytes | None:
    """``err`` pickled for the parent, or ``None`` where it cannot be (an attribute that does not pickle)."""
    try:
        return pickle.dumps(err)
    except Exception:
        return None


def _receive(queue, results: dict[int, Any], failures: dict[int, str], errors: dict[int, BaseException]) -> None:
    """File one worker's report: a pickled result (our own child's bytes), or a traceback and the exception."""
    rank, ok, payload = queue.get()
    if ok:
        results[rank] = pickle.loads(payload)
        return
    failures[rank], pickled = payload
    if pickled is not None:
        try:
            errors[rank] = pickle.loads(pickled)
        except Exception:  # an exception class whose __init__ takes other arguments than it stores: text only
            pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 180.0,
    backend: str | None = "gloo",
    fresh_interpreters: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes; return each rank's result.

    ``backend=None`` lets torch pick per device (gloo for CPU tensors, NCCL for CUDA ones).
    ``fresh_interpreters=True`` starts every worker as a new interpreter even with gloo: for measuring
    what a worker itself costs (memory, start-up), which pages shared with a fork server would blur.

    Raises :class:`DistributedTestError` with every failing worker's traceback, or naming the ranks
    still running when ``timeout`` expires (they are killed).
    """
    ctx = _context(backend, fresh_interpreters)
    queue = ctx.SimpleQueue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    environ = dict(os.environ)
    procs = [
        ctx.Process(
            target=_worker, args=(rank, world_size, port, fn, tuple(args), backend, queue, environ), daemon=False
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    errors: dict[int, BaseException] = {}
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while len(results) + len(failures) < world_size:
            if not queue.empty():
                _receive(queue, results, failures, errors)
                if failures:
                    time.sleep(1.0)  # let the other ranks report their own error before we stop them
                    while not queue.empty():
                        _receive(queue, results, failures, errors)
                    break
                continue
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
            if dead and queue.empty():
                time.sleep(0.5)
                if queue.empty():
                    for i in dead:
                        failures[i] = f"worker exited with code {procs[i].exitcode} before reporting a result"
                        if (procs[i].exitcode or 0) < 0:  # died of a signal (multiprocessing's -N)
                            errors[i] = WorkerKilled(-(procs[i].exitcode or 0))
                    break
            if time.monotonic() > deadline:
                timed_out = True  # (the workers are killed below, not waited for)
                missing = sorted(set(range(world_size)) - set(results) - set(failures))
                raise DistributedTestError(
                    f"{fn.__name__}: ranks {missing} still running when the {timeout:g} s allowed ran out (a slow "
                    f"start or step, or a collective some rank never joined); finished: {sorted(results)}"
                )
            time.sleep(0.01)
    finally:
        for proc in procs:
            proc.join(timeout=0.1 if failures or timed_out else 5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        del store
    if failures:
        report = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures.items()))
        raise DistributedTestError(f"{fn.__name__} failed on ranks {sorted(failures)}:\n{report}", errors)
    return [results[rank] for rank in range(world_size)]
