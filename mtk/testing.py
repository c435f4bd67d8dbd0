"""Run a function in N CPU processes joined by a gloo process group, from an ordinary pytest test.

    def _check(rank, world_size, scale):       # module level, so the spawned workers can import it
        ...
        return some_picklable_value

    def test_thing():
        results = run_distributed(_check, world_size=2, args=(0.5,))   # one value per rank

Each worker gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` on a free
port and ``OMP_NUM_THREADS=1`` (several processes share few cores). A worker's exception fails the
test with that worker's traceback; a worker that hangs (a collective nobody else joined) fails it
after ``timeout`` seconds instead of blocking the suite.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp

__all__ = ["DistributedTestError", "assert_close_rel", "free_port", "max_rel_error", "run_distributed"]

RTOL = 1e-5  # the exactness bar: fp32 parallel results vs the single-process reference


class DistributedTestError(AssertionError):
    """One or more workers failed or timed out; the message holds their tracebacks."""


def max_rel_error(actual, expected, scale_floor: float = 0.0) -> float:
    """``max|actual - expected| / max(max|expected|, scale_floor)``: one number per tensor.

    ``scale_floor`` is for tensors whose exact value is (near) zero, e.g. the gradient of an attention
    key bias, which softmax makes exactly zero: their entries are rounding noise, so they are measured
    against the scale of the quantity they belong to (the model's largest gradient) instead.
    """
    import torch

    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    if actual.shape != expected.shape:
        raise AssertionError(f"shape mismatch: {tuple(actual.shape)} vs expected {tuple(expected.shape)}")
    scale = max(expected.abs().max().item() if expected.numel() else 0.0, scale_floor)
    diff = (actual - expected).abs().max().item() if expected.numel() else 0.0
    return diff / scale if scale > 0 else diff


def assert_close_rel(actual, expected, what: str = "tensor", tol: float = RTOL, scale_floor: float = 0.0) -> float:
    """Fail unless ``max_rel_error(actual, expected, scale_floor) <= tol``; returns the error."""
    err = max_rel_error(actual, expected, scale_floor)
    if not err <= tol:
        raise AssertionError(f"{what}: max relative error {err:.3e} > {tol:.0e}")
    return err


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: Sequence[Any], backend: str, queue) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 180.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; return each rank's result.

    Raises :class:`DistributedTestError` with every failing worker's traceback, or naming the ranks
    still running when ``timeout`` expires (they are killed).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, fn, tuple(args), backend, queue), daemon=False)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(failures) < world_size:
            if not queue.empty():
                rank, ok, payload = queue.get()
                (results if ok else failures)[rank] = payload
                if failures:
                    time.sleep(1.0)  # let the other ranks report their own error before we stop them
                    while not queue.empty():
                        rank, ok, payload = queue.get()
                        (results if ok else failures)[rank] = payload
                    break
                continue
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
            if dead and queue.empty():
                time.sleep(0.5)
                if queue.empty():
                    for i in dead:
                        failures[i] = f"worker exited with code {procs[i].exitcode} before reporting a result"
                    break
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results) - set(failures))
                raise DistributedTestError(
                    f"{fn.__name__}: ranks {missing} still running after {timeout:.0f}s (a collective not "
                    f"joined by every rank?); finished: {sorted(results)}"
                )
            time.sleep(0.01)
    finally:
        for proc in procs:
            proc.join(timeout=5 if not failures else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failures:
        report = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures.items()))
        raise DistributedTestError(f"{fn.__name__} failed on ranks {sorted(failures)}:\n{report}")
    return [results[rank] for rank in range(world_size)]
