"""How a training script's ``main`` runs on every rank: bad input is one line and exit status 2 from whichever
rank meets it, a collective that lost its peer one line and exit status 1, a Ctrl-C during start-up one line and
exit status 130, never a traceback from mtk. A launched worker leaves without Python's interpreter teardown."""

import atexit
import contextlib
import hashlib
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

from mtk.errors import MtkError, allocation_failure, process_group_failure, unusable_name
from mtk.parallel.state import group_timeout, groups_made

__all__ = ["out_of_memory", "peer_failure", "report_mtk_errors", "run_main"]


def _rank() -> int:
    """This process's rank as a launcher exported it (0 without one, or where ``RANK`` holds no number)."""
    text = os.environ.get("RANK", "0").strip()
    return int(text) if text.isdecimal() else 0


def _speaks_for_all() -> bool:
    """Whether this process reports a line before a process group exists: rank 0 of a launched job (its peers
    check the same arguments), or a process alone, whatever ``RANK`` was set to by hand."""
    world = os.environ.get("WORLD_SIZE", "1").strip()
    return _rank() == 0 or not world.isdecimal() or int(world) <= 1


def _first_report(message: str) -> bool:
    """Whether no other rank has reported this exact message yet (so this rank prints it).

    The first rank to fail with a message claims it with an atomic compare-and-set on the process
    group's store (not a collective: the other ranks may be anywhere); later ranks with the same
    message stay quiet, ranks with a different one print theirs. Without a process group, rank 0 reports for all
    (before ``init_process_group`` every rank checks the same arguments).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return _speaks_for_all()
    me = str(_rank())
    key = "mtk/error/" + hashlib.sha1(message.encode()).hexdigest()  # one key per distinct message
    try:
        store = dist.distributed_c10d._get_default_store()
        first = store.compare_set(key, "", me)  # sets it to this rank only if no rank has yet
    except Exception:  # a store that is gone (its host rank exited): say it rather than nothing
        return True
    return first == me.encode()


def run_main(main: Callable[[], None], prog: str) -> None:
    """Run a script's ``main``; bad input becomes ``<prog>: error: <message>`` and exit status 2, without a
    traceback. Whichever rank hits it reports it (with its rank when it is not 0), each distinct
    message once, so a file only rank 3 reads is named even though rank 0 is fine.

    A collective that fails because a peer died or stopped answering (a hang past the process
    group's timeout) is one line too, printed by the first rank that sees it, exit status 1: the
    rank that caused it has printed its own error.

    In a launcher's worker (``accelerate launch``, torchrun, ``deepspeed``) a ``main`` that returns exits without
    the interpreter's teardown (:func:`_leave`).
    """
    _run(main, prog)  # an error exits as Python does: slower, which gives a peer time to print its line first
    if _launched_worker(prog):
        _leave(0)
    _let_collectives_settle()  # (a caller that goes on, or ends through the teardown: a script named otherwise)


def _run(main: Callable[[], None], prog: str) -> None:
    if threading.current_thread() is threading.main_thread():  # a script stopped Ctrl-C quietly while it imported
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C before the script's ExitSignal took over (start-up): no traceback
        if _speaks_for_all():
            tqdm.write(f"{prog}: interrupted (SIGINT); stopped without saving", file=sys.stderr)
        sys.exit(130)  # the shell's status for a program that SIGINT stopped
    except Exception as err:
        line = _error_line(err, _SMALLER_BY_SCRIPT.get(prog, _SMALLER_BY_SCRIPT["finetune.py"]))
        if line is None:
            raise
        message, key, status = line
        _report(prog, message, key)
        sys.exit(status)


def _error_line(err: BaseException, smaller: str) -> tuple[str, str, int] | None:
    """``err`` as ``(one line, the key it is reported once under, exit status)``: mtk's refusals and a name that
    cannot be used (2), an allocation that failed (naming the ``smaller`` settings to lower) and a collective whose
    peer died or hung (1); ``None`` for anything else (a bug: its traceback)."""
    if isinstance(err, MtkError):
        return str(err), str(err), 2
    if not isinstance(err, Exception):
        return None
    unusable = unusable_name(err)
    if unusable is not None:
        return str(unusable), str(unusable), 2
    memory = out_of_memory(err, smaller)
    if memory is not None:
        return memory, memory, 1
    start = process_group_failure(err)  # (a script's own TrainingArguments form the group before mtk's code runs)
    if start is not None:
        return str(start), str(start), 2
    detail = peer_failure(err)
    if detail is None:
        return None
    message = (
        f"a collective failed ({detail}): another rank exited or stopped answering (its error, if any, is above); "
        f"collectives wait {_timeout_text()} for a peer"
    )
    return message, "peer failure", 1


# what each script calls the settings that set its memory (a user's own script: the quantities themselves)
_SMALLER_BY_SCRIPT = {
    "finetune.py": "--batch_size, --seq_len or --lora_r",
    "run.py": "--batch_size, --seq_len or --lora_r",
    "classify.py": "--batch_size or --max_length",
    "sft.py": "--per_device_train_batch_size, --max_length or the LoRA rank",
    "dpo.py": "--per_device_train_batch_size, --max_length or the LoRA rank",
}
_OWN_SCRIPT = "batch, sequence length or LoRA rank"


def out_of_memory(err: BaseException, smaller: str = _SMALLER_BY_SCRIPT["finetune.py"]) -> str | None:
    """``err`` as one line where an allocation failed (a device's ``OutOfMemoryError``, the CPU allocator's
    refusal): what was asked for and what to change (``smaller``: the script's settings); ``None`` for anything
    else."""
    remedy = f"use a smaller {smaller}, recompute, or more ranks (mtk plan estimates a layout's memory per rank)"
    found = allocation_failure(err, remedy)
    return None if found is None else str(found)


def _launched_worker(prog: str) -> bool:
    """Whether this process is a launcher's worker running the script ``prog`` (not a test calling ``run_main``, nor
    a script that goes on after it: those wait for the groups' threads instead, :func:`_let_collectives_settle`)."""
    return "LOCAL_RANK" in os.environ and Path(sys.argv[0]).name == prog


def _leave(code: int) -> None:
    """Exit with ``code`` after the ``atexit`` handlers and a flush, skipping the interpreter's teardown.

    Process groups that modules still reference (every TP layer holds its group) are only freed then, and a gloo
    worker thread that drops the last reference to a tensor while the interpreter is being torn down takes the GIL,
    which kills the thread inside C++ code: the process aborts ("terminate called without an active exception",
    exit status -6) after a run that finished and saved everything. Seen about once per full test run (some 200
    launches of 4 to 8 processes on 2 cores). An error exit keeps Python's slower teardown: the first rank to fail
    exits, the launcher stops the others, and a rank that claimed the error's line needs that time to print it."""
    atexit.unregister(_let_collectives_settle)  # (no teardown follows)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def report_mtk_errors(prog: str) -> None:
    """For a script whose ``main`` mtk does not run (a user's Trainer or TRL script, an own loop): an mtk error that
    reaches the top is ``<prog>: error: <message>``, reported once over the ranks as :func:`run_main` does, without
    a traceback, and so are an allocation that failed and a collective whose peer exited (the rank that waited on
    the one that raised: its traceback went through mtk's collectives); any other exception keeps Python's
    report. The exit status is Python's for an uncaught error (1)."""
    previous = sys.excepthook
    if getattr(previous, "_mtk", False):
        return

    def hook(kind, value, trace):
        line = _error_line(value, _OWN_SCRIPT)
        if line is None:
            previous(kind, value, trace)
        else:
            _report(prog, line[0], line[1])

    hook._mtk = True  # type: ignore[attr-defined]
    sys.excepthook = hook
    atexit.register(_let_collectives_settle)


# How long an ending process waits for the process groups' threads to free the last collective's tensors: they need
# a moment of the GIL, which a busy machine may not give them before the interpreter's teardown begins.
_SETTLE_S = 0.2


def _let_collectives_settle() -> None:
    """At exit of a script whose ``main`` mtk does not run (an own loop, a user's Trainer script), before the
    interpreter's teardown: a gloo worker thread destroys a collective's work after the caller's wait returned, and
    where that frees a tensor Python has let go of, it takes the GIL; in the teardown that ends the thread inside C++
    code and aborts the process ("terminate called without an active exception", exit status -6) after a run that
    finished: 2 in 3 launches of an own loop that generates at TP 2, whose last collective is an all-gather of
    views. Waiting here, the GIL released, lets the threads finish. (:func:`run_main` skips the teardown instead:
    :func:`_leave`; nothing frees the groups' threads sooner, since gloo's groups join them only when the last
    reference, which every TP layer holds, is gone.)"""
    if groups_made():
        time.sleep(_SETTLE_S)


def _report(prog: str, message: str, key: str) -> None:
    rank = _rank()
    if _first_report(key):
        where = f"[rank {rank}] " if rank else ""
        # tqdm.write clears this process's bar; rank 0's bar on the shared stream is another process's, so another
        # rank starts a fresh line first (a half-drawn bar would otherwise open the error's line)
        start = "\n" if rank else ""
        tqdm.write(f"{start}{prog}: error: {where}{message}", file=sys.stderr)
    else:  # another rank speaks for it (rank 0 before a process group exists): this rank's exit makes the launcher
        # stop the job, which could stop that rank before its line (a refusal seen once with no line and exit 1)
        time.sleep(_GRACE_S)
    if rank == 0 and _hosts_the_store():
        time.sleep(_GRACE_S)  # the store dies with this process: give failing peers time to report


# How gloo and NCCL word a collective that lost its peer (gloo raises a plain RuntimeError).
_PEER_LOST = (
    "Timed out waiting",
    "Connection closed by peer",
    "Connection reset by peer",
    "collective operation timeout",
)


def peer_failure(err: Exception) -> str | None:
    """The gist of a collective's error when a peer died or hung, else ``None`` (a bug: keep the traceback). gloo's
    errors are plain ``RuntimeError``s, known by their words only where there are peers (a launched job of several
    processes, its group made or already destroyed): a process alone whose own code failed with "Connection reset by
    peer" (a download) keeps its traceback."""
    import torch.distributed as dist

    text = str(err).strip()
    world = os.environ.get("WORLD_SIZE", "1").strip()  # (the launcher's: the group may be gone, or not yet made)
    peers = (world.isdecimal() and int(world) > 1) or (dist.is_initialized() and dist.get_world_size() > 1)
    if not isinstance(err, dist.DistError) and not (
        peers and isinstance(err, RuntimeError) and any(sign in text for sign in _PEER_LOST)
    ):
        return None
    first = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else type(err).__name__)  # "[pair.cc:553] "
    return first.split(". This is typically")[0].rstrip(".")


def _timeout_text() -> str:
    timeout = group_timeout()
    return f"{timeout.total_seconds():g} s" if timeout is not None else "torch's default time"


_GRACE_S = 2.0


def _hosts_the_store() -> bool:
    """Rank 0 hosts the process group's store unless torchrun's agent does (accelerate launch, torchrun)."""
    import torch.distributed as dist

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return dist.is_available() and dist.is_initialized() and not agent
