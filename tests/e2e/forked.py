"""Launch a script's ranks as torchrun does, but forked from the suite's fork server instead of fresh interpreters.

Why: an e2e launch spends ~7 s of CPU before the first step (the launcher and every rank import torch,
transformers, accelerate, datasets, ...) and well under one second training the tiny models; the suite makes
hundreds of launches on 2 cores. The fork server (:mod:`mtk.spawn`) imported all that once, so a rank forked
from it starts in milliseconds, still a new process with nothing left over from the last one.

What stays real: accelerate's own launcher code reads the YAML, validates the command and builds the workers'
environment (``accelerate.commands.launch.launch_command`` runs as is); only its last step, torchrun starting
the processes (or ``python script.py`` for one process), is replaced by :func:`run_ranks`, which gives each
rank torchrun's environment (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, ``TORCHELASTIC_*``, the store held by
the launcher) and runs the script as ``__main__`` with its output in files. A failed rank stops the others
with SIGTERM, as torchrun's agent does, and the launch exits 1, as ``accelerate launch`` does. torchrun's own
agent (signal forwarding, its failure report) and the launcher's process tree (mtk reads the YAML named on
the ``accelerate launch`` command line of an ancestor process) are only there in real launches:
``accelerate_launch(..., real=True)``, or ``MTK_TEST_LAUNCH=subprocess`` for every launch.

What a fork cannot reproduce: output printed while the preloaded modules import (a real rank's stderr starts with
it), and the interpreter's teardown (a forked process ends with ``os._exit`` after its threads and ``atexit``
handlers). Run the suite with ``MTK_TEST_LAUNCH=subprocess`` now and then for those.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast
from unittest import mock

import torch
import torch.distributed as dist

from mtk import spawn
from mtk.spawn import free_port

__all__ = ["accelerate_in_forks", "command_in_forks", "forks_wanted", "run_deepspeed", "run_python", "run_ranks"]

# What the examples and test scripts import beyond mtk.spawn's list: paid once by the fork server.
PRELOAD = (
    "datasets",
    "deepspeed",
    "trl",
    "torch.utils.tensorboard",
    "accelerate.commands.launch",
    "transformers.trainer",  # not mtk.trainers: importing it installs an excepthook named after sys.argv[0]
    "mtk.training.setup",
    "mtk.training.entry",
    "mtk.integrations.accelerate.save",
    "mtk.data",
    "mtk.lora",
    "tests.e2e.forked",
)
_STOP_GRACE_S = 30.0  # torchrun's agent: SIGTERM, then SIGKILL after this long


def forks_wanted() -> bool:
    """Launches fork from the fork server unless ``MTK_TEST_LAUNCH=subprocess`` asks for real ones."""
    return os.environ.get("MTK_TEST_LAUNCH", "fork") != "subprocess"


def _rank_main(
    script: str,
    argv: Sequence[str],
    cwd: str,
    environ: dict[str, str],
    sys_path: Sequence[str],
    out: str,
    err: str,
    launched: bool,
) -> None:
    """One process: its environment, output to files, ``script`` run as ``python script argv`` (``-m module`` for
    ``python -m module argv``); ``launched``: as a launcher starts a rank (``python -u``, a session of its own)."""
    os.setsid()  # a process group of its own, as torchrun starts each rank: stopping it stops its children too
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    if launched:  # torchrun and DeepSpeed's launcher run `python -u`: a rank stopped by a signal keeps its output
        for stream in (sys.stdout, sys.stderr):
            cast(Any, stream).reconfigure(write_through=True)
    os.environ.clear()
    os.environ.update(environ)
    _as_a_main_process()
    torch.set_num_threads(int(environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())
    os.chdir(cwd)
    module = script.removeprefix("-m ") if script.startswith("-m ") else None
    sys.argv = [module or script, *argv]
    sys.path[:] = [cwd if module else str(Path(cwd, script).parent), *sys_path]  # as a fresh interpreter has it
    code: int | str | None = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(Path(cwd, script)), run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # what python does with an uncaught exception (the script's own excepthook included)
        sys.excepthook(*sys.exc_info())
        code = 1
    try:  # the interpreter's own exit: wait for non-daemon threads, then the atexit handlers
        cast(Any, threading)._shutdown()
        atexit._run_exitfuncs()
    finally:
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def _as_a_main_process() -> None:
    """What multiprocessing tells a fresh interpreter: the main process (no parent, named ``MainProcess``; some
    libraries check it), children none yet, and the platform's default start method."""
    process = cast(Any, multiprocessing.process)
    this = process._current_process
    this._name, this._identity, this._parent_pid, this._parent_name = "MainProcess", (), None, None
    process._parent_process = None
    process._children = set()
    multiprocessing.set_start_method(None, force=True)


@functools.cache
def _interpreter_path(pythonpath: str) -> tuple[str, ...]:
    """``sys.path`` of a fresh ``python`` with ``PYTHONPATH=pythonpath``, without its first entry (the script's
    folder): the fork server's is the test process's, which holds the repository root (pytest put it there)."""
    probe = "import json, sys; print(json.dumps(sys.path[1:]))"
    env = {**os.environ, "PYTHONPATH": pythonpath}
    found = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    return tuple(json.loads(found.stdout))


def run_ranks(
    script: str,
    argv: Sequence[str],
    nproc: int,
    environ: dict[str, str],
    *,
    cwd: Path,
    command: Sequence[str],
    timeout: float = 600.0,
) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node nproc script argv``: torchrun's environment for each rank, the launcher holding
    the store (its agent's, as with accelerate's static rendezvous).

    ``stdout``/``stderr`` are the ranks' own, rank by rank (torchrun interleaves them; tests search them).
    The exit status is 0 when every rank exited 0, else 1 (``accelerate launch`` and torchrun alike)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = {
        **environ,
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    if nproc > 1:
        base.setdefault("OMP_NUM_THREADS", "1")
    ranks = [({**base, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)}, argv) for r in range(nproc)]
    try:
        codes, stdout, stderr = _start_and_collect(script, ranks, cwd=cwd, command=command, timeout=timeout)
    finally:
        del store
    return subprocess.CompletedProcess(list(command), 1 if any(codes) else 0, stdout, stderr)


def run_deepspeed(
    script: str, argv: Sequence[str], nproc: int, environ: dict[str, str], *, cwd: Path, command: Sequence[str],
    timeout: float = 600.0,
) -> subprocess.CompletedProcess:  # fmt: skip
    """``deepspeed --num_gpus nproc script argv`` on one node: DeepSpeed's launcher's environment (rank 0 hosts the
    store on ``MASTER_PORT``) and ``--local_rank=R`` before the script's arguments; the status of the first rank
    that failed, as DeepSpeed's launcher exits with."""
    base = {
        **environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(nproc),
        "CROSS_RANK": "0",
        "CROSS_SIZE": "1",
        "LOCAL_SIZE": str(nproc),
    }
    ranks = [({**base, "RANK": str(r), "LOCAL_RANK": str(r)}, [f"--local_rank={r}", *argv]) for r in range(nproc)]
    codes, stdout, stderr = _start_and_collect(script, ranks, cwd=cwd, command=command, timeout=timeout)
    failed = next((code for code in codes if code), 0)
    status = failed if failed > 0 else int(failed != 0)  # a rank killed by a signal (a negative code): 1
    return subprocess.CompletedProcess(list(command), status, stdout, stderr)


def run_python(
    script: str, argv: Sequence[str], environ: dict[str, str], *, cwd: Path, command: Sequence[str], timeout: float
) -> subprocess.CompletedProcess:
    """``python script argv`` (``script`` ``-m module`` for ``python -m module``): its own status and output."""
    codes, stdout, stderr = _start_and_collect(
        script, [(environ, argv)], cwd=cwd, command=command, timeout=timeout, launched=False
    )
    return subprocess.CompletedProcess(list(command), codes[0], stdout, stderr)


def _start_and_collect(
    script: str,
    processes: list[tuple[dict[str, str], Sequence[str]]],
    *,
    cwd: Path,
    command: Sequence[str],
    timeout: float,
    launched: bool = True,
) -> tuple[list[int], str, str]:
    """One process per (environment, arguments), forked from the fork server: exit codes, and the output of each,
    process by process. A timeout raises :class:`subprocess.TimeoutExpired` with the output so far."""
    ctx = spawn.fork_context()
    with tempfile.TemporaryDirectory(prefix="mtk-ranks-") as logs:
        files = [(f"{logs}/{rank}.out", f"{logs}/{rank}.err") for rank in range(len(processes))]

        def read(paths: list[str]) -> str:  # every process's, in order (one may not have started)
            return "".join(Path(p).read_text(errors="replace") for p in paths if Path(p).exists())

        def output() -> tuple[str, str]:
            return read([out for out, _ in files]), read([err for _, err in files])

        procs: list = []
        try:
            for (env, argv), (out, err) in zip(processes, files):
                sys_path = _interpreter_path(env.get("PYTHONPATH", ""))
                arguments = (script, tuple(argv), str(cwd), env, sys_path, out, err, launched)
                procs.append(ctx.Process(target=_rank_main, args=arguments))
                procs[-1].start()
            if not _wait(procs, time.monotonic() + timeout):
                raise subprocess.TimeoutExpired(list(command), timeout, *output())
        finally:
            for proc in procs:
                if proc.is_alive():
                    _signal(proc, signal.SIGKILL)
                proc.join()
        stdout, stderr = output()
    return [proc.exitcode for proc in procs], stdout, stderr


def _wait(procs: list, deadline: float) -> bool:
    """Until every rank exits (``True``) or ``deadline`` passes (``False``); after the first failure, the rest get
    SIGTERM, then SIGKILL (torchrun's agent, which signals each rank's process group)."""
    stop_at = None
    while any(proc.is_alive() for proc in procs):
        if time.monotonic() > deadline:
            return False
        if stop_at is None and any(proc.exitcode not in (None, 0) for proc in procs):
            for proc in procs:
                if proc.is_alive():
                    _signal(proc, signal.SIGTERM)
            stop_at = time.monotonic() + _STOP_GRACE_S
        if stop_at is not None and time.monotonic() > stop_at:
            for proc in procs:
                if proc.is_alive():
                    _signal(proc, signal.SIGKILL)
        time.sleep(0.02)
    return True


def _signal(proc, sig: int) -> None:
    """``sig`` to the process's group (its children too), or to the process before it has made its group."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)


class _Launch:
    """accelerate's launcher with its process start replaced by :func:`run_ranks`; records the result."""

    def __init__(self, cwd: Path, command: Sequence[str], timeout: float) -> None:
        self.cwd, self.command, self.timeout = cwd, command, timeout
        self.result: subprocess.CompletedProcess | None = None

    def torchrun(self, args) -> None:  # torch.distributed.run.run(args), under accelerate's patched environment
        if str(args.nnodes) not in ("1", "1:1"):
            raise ValueError(f"forked launches run one node; got --nnodes {args.nnodes}: accelerate_launch(real=True)")
        if args.module or args.no_python or int(args.max_restarts):
            raise ValueError("forked launches run a script once: --module, --no_python and --max_restarts need "
                             "accelerate_launch(real=True)")  # fmt: skip
        nproc = int(args.nproc_per_node)
        self.result = run_ranks(
            args.training_script,
            args.training_script_args,
            nproc,
            dict(os.environ),
            cwd=self.cwd,
            command=self.command,
            timeout=self.timeout,
        )

    def simple(self, args) -> None:  # accelerate's simple_launcher: `python script args` with its environment
        from accelerate.commands.launch import prepare_simple_launcher_cmd_env

        cmd, environ = prepare_simple_launcher_cmd_env(args)
        if Path(cmd[0]).name != Path(sys.executable).name:  # --no_python
            raise ValueError(f"forked launches run python scripts; got {cmd[0]}: accelerate_launch(real=True)")
        script, *argv = cmd[1:] if cmd[1] != "-m" else [f"-m {cmd[2]}", *cmd[3:]]
        plain = run_python(script, argv, environ, cwd=self.cwd, command=self.command, timeout=self.timeout)
        self.result = subprocess.CompletedProcess(plain.args, int(plain.returncode != 0), plain.stdout, plain.stderr)


def accelerate_in_forks(
    launch_args: Sequence[str], *, cwd: Path, environ: dict[str, str] | None, timeout: float
) -> subprocess.CompletedProcess:
    """``accelerate launch <launch_args>`` with its ranks forked (module docstring)."""
    import accelerate.commands.launch as launcher
    import torch.distributed.run

    command = ["accelerate", "launch", *launch_args]
    launch = _Launch(cwd, command, timeout)
    saved = dict(os.environ)
    here = os.getcwd()
    try:
        os.chdir(cwd)
        if environ is not None:
            os.environ.clear()
            os.environ.update(environ)
        args = launcher.launch_command_parser().parse_args(list(launch_args))
        with (
            mock.patch.object(torch.distributed.run, "run", launch.torchrun),
            mock.patch.object(launcher, "simple_launcher", launch.simple),
        ):
            launcher.launch_command(args)
    except subprocess.TimeoutExpired:  # as subprocess.run raises it
        raise
    except SystemExit as stop:  # the launcher's own refusal (argparse)
        return subprocess.CompletedProcess(command, stop.code if isinstance(stop.code, int) else 1, "", "")
    except Exception:
        return subprocess.CompletedProcess(command, 1, "", traceback.format_exc())
    finally:
        os.environ.clear()
        os.environ.update(saved)
        os.chdir(here)
    assert launch.result is not None, command
    return launch.result


def command_in_forks(
    command: Sequence[str], *, cwd: Path, environ: dict[str, str] | None, timeout: float
) -> subprocess.CompletedProcess | None:
    """``command`` run from the fork server when it is one of the suite's own kinds, else ``None``:
    ``torchrun``/``deepspeed`` with one node's process count (and a port), ``python script ...``,
    ``python -m module ...`` and the ``mtk`` console script."""
    env = dict(os.environ if environ is None else environ)
    program, *rest = command
    name = Path(program).name
    if name in ("torchrun", "deepspeed"):
        options = {}
        while len(rest) > 1 and rest[0].startswith("--"):
            key, value, *rest = rest
            options[key.lstrip("-").replace("-", "_")] = value
        count = "nproc_per_node" if name == "torchrun" else "num_gpus"
        if set(options) - {count, "master_port"} or not rest or rest[0].startswith("-"):
            return None
        script, *argv = rest
        run = run_ranks if name == "torchrun" else run_deepspeed
        return run(script, argv, int(options[count]), env, cwd=cwd, command=command, timeout=timeout)
    if name == "mtk":
        script, argv = "-m mtk.cli.main", rest
    elif name.startswith("python") and len(rest) > 1 and rest[0] == "-m":
        script, argv = f"-m {rest[1]}", rest[2:]
    elif name.startswith("python") and rest and not rest[0].startswith("-"):
        script, argv = rest[0], rest[1:]
    else:
        return None
    return run_python(script, argv, env, cwd=cwd, command=command, timeout=timeout)
