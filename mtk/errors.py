"""Every error mtk raises for bad input (a layout, a config, a model, a checkpoint, data), in one place.

Each carries a one-line message saying what is wrong and what is allowed. Entry points catch
:class:`MtkError` and print ``<prog>: error: <message>`` with a non-zero exit, never a traceback
(:func:`mtk.training.entry.run_main` for scripts, ``mtk``'s dispatcher for its subcommands).
"""

import contextlib
import errno
import re
import sys
import traceback
from collections.abc import Iterator

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "LayoutError",
    "ModelSpecError",
    "MtkError",
    "TrainingError",
    "UnsupportedModelError",
    "WorkerKilled",
    "allocation_failure",
    "library_refusals",
    "process_group_failure",
    "process_group_start",
    "unusable_name",
]


class MtkError(ValueError):
    """Bad input, explained in one line."""


class ConfigError(MtkError):
    """A parallelism or run setting with an invalid value, or two settings that disagree."""


class LayoutError(MtkError):
    """A world size that does not factor into the requested TP x PP x DP grid."""


class ModelSpecError(MtkError):
    """A ``--model`` that is neither a built-in name nor a readable local HF directory."""


class UnsupportedModelError(MtkError):
    """The model (or this TP size) cannot be converted by any rule set."""


class CheckpointError(MtkError):
    """A checkpoint (mtk's or an HF directory) that is missing, incomplete or does not match the model."""


class DataError(MtkError):
    """Training data that cannot be read or tokenized."""


class TrainingError(MtkError):
    """A run that cannot go on safely (e.g. non-finite gradients); stopped before it is saved."""


# What to do, added to a library's refusal that does not say it (matched by the start of its first line).
_LAUNCHER = (
    "start the run with accelerate launch, torchrun or deepspeed, or unset the launcher's variables (accelerate "
    "launch without a config file or --multi_gpu starts one plain process on a machine without GPUs)"
)
_HINTS = {
    "Some specified arguments are not used by the HfArgumentParser": "check the spelling; --help lists the options",
    # accelerate, where a launcher's variables (ACCELERATE_USE_DEEPSPEED, WORLD_SIZE) are set without a launcher
    "Default process group has not been initialized": (  # (python script.py --deepspeed X.json too)
        "a process group was asked for without a launcher (DeepSpeed, a ddp_backend, or a launcher's variable set "
        f"by hand): {_LAUNCHER}"
    ),
    "Unexpected UTF-8 BOM": "a JSON file given (--deepspeed, a config) starts with a byte-order mark; save it as "
    "UTF-8 without one",
    "Tried to launch on distributed with multinode": f"WORLD_SIZE is set without a launcher: {_LAUNCHER}",
    # transformers' TrainingArguments, before mtk sees them (mtk sets use_cpu itself only for the other runs)
    "Your setup doesn't support bf16/gpu": "this machine has no accelerator: add --use_cpu True (bf16 autocast "
    "on the CPU), or leave bf16 off",
}


# what a TypeError says when keywords a user passed through (lr_scheduler_kwargs, optim_args) do not fit the function
_KEYWORD_MISTAKES = (
    "unexpected keyword argument",
    "got multiple values for",
    "argument after ** must be a mapping",
    "required positional argument",  # a scheduler's own setting left out (warmup_stable_decay's num_decay_steps)
    "required keyword-only argument",
)


@contextlib.contextmanager
def library_refusals() -> Iterator[None]:
    """transformers, TRL and torch refuse a bad setting (an unknown flag, two fields that disagree, an optimizer
    whose package is missing, an ``output_dir`` under a file, a keyword ``lr_scheduler_kwargs`` passes on that the
    scheduler does not take or one it needs and was not given) with a ``ValueError``, ``ImportError``, an
    ``OSError`` (a path given that is a folder, missing, or not readable; a name that is neither a file nor a
    repository) or a ``TypeError`` of keywords: inside this block, that is a :class:`ConfigError` carrying the
    first line of their message, so an entry point reports it in one line. Meant for setting a run up (parsing,
    building the arguments, the trainer, its optimizer and scheduler), never around training itself, where the
    same errors are bugs whose traceback is wanted."""
    try:
        yield
    except MtkError:
        raise
    except (ValueError, ImportError, OSError, TypeError) as err:
        if isinstance(err, TypeError) and not any(sign in str(err) for sign in _KEYWORD_MISTAKES):
            raise  # keywords the user passed through (lr_scheduler_kwargs, optim_args) are settings; others are bugs
        unusable = unusable_name(err)
        if unusable is not None:  # (a full disk, a read-only place: what to do about it)
            raise unusable from err
        if isinstance(err, OSError) and err.filename is not None and str(err.filename) not in str(err):
            err = OSError(f"{err.filename}: {err.strerror or err}")  # (the name it is about, in the line)
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        message = lines[0] if lines else type(err).__name__
        hint = next((hint for start, hint in _HINTS.items() if message.startswith(start)), None)
        if isinstance(err, OSError) and hint is None and err.errno is not None:
            hint = _PATH_HINTS.get(err.errno)
        if isinstance(err, TypeError) and "required" in message:
            hint = "give it in lr_scheduler_kwargs (a JSON mapping), or optim_args for the optimizer"
        raise ConfigError(f"{message.rstrip('.')}; {hint}" if hint else message) from err


@contextlib.contextmanager
def process_group_start() -> Iterator[None]:
    """Forming the process group (inside accelerate's or transformers' set-up, or mtk's): its failure is one line
    (:func:`process_group_failure`)."""
    try:
        yield
    except RuntimeError as err:
        failure = process_group_failure(err)
        if failure is None:
            raise
        raise failure from err


def process_group_failure(err: BaseException) -> MtkError | None:
    """``err`` as one line where ``init_process_group`` raised it (a ``GLOO_SOCKET_IFNAME`` naming no interface, a
    peer that never came, a ``MASTER_ADDR`` that does not resolve: torch's ``RuntimeError``, its
    ``DistNetworkError`` and ``DistStoreError`` included): the machine's or the launcher's setting, not a bug.
    ``None`` for anything else."""
    if not isinstance(err, RuntimeError) or isinstance(err, MtkError):
        return None
    if not any(frame.name == "init_process_group" for frame in traceback.extract_tb(err.__traceback__)):
        return None
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    first = re.sub(r"^\[enforce fail at [^\]]*\]\s*", "", lines[0] if lines else type(err).__name__)
    return ConfigError(
        f"the processes could not form their process group ({first[:200]}); check the launcher's MASTER_ADDR and "
        "MASTER_PORT and the network interface it names (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME on GPUs)"
    )


# what to do about a path given that is not what the setting takes (a library's OSError names only the path)
_PATH_HINTS = {
    errno.EISDIR: "a folder was given where a file is wanted: give the file's path",
    errno.ENOENT: "check the path (relative paths are read from the folder the run starts in)",
    errno.ENOTDIR: "a part of the path is a file, not a folder: check the path",
}


# what a file system says of a name it cannot use, whichever path the user gave (Python's Path.is_file() and
# is_dir() raise these rather than answering False), and what to do about it
_NAME_ERRNOS = {
    errno.ENAMETOOLONG: "a name may take at most 255 bytes, a path 4096; give a shorter path",
    errno.EILSEQ: "give a name the file system takes",
    errno.ELOOP: "its symbolic links point back at themselves; give a path without the loop",
    # a place the run cannot write at all (where a library, not mtk, first tried: the Trainer's or tensorboard's mkdir)
    errno.EROFS: "the file system is read-only; give a writable place",
    errno.EACCES: "this user may not use it; give a place this user may read and write, or change its permissions",
    errno.ENOSPC: "the file system is full; free space, or give a place on another file system",
    errno.EDQUOT: "the disk quota is used up; free space, or give a place on another file system",
}


def unusable_name(err: BaseException) -> MtkError | None:
    """``err`` as one line where it is about a name the user gave that cannot be used at all, wherever the script
    first touched it: a path too long for the file system (a name over 255 bytes, a path over 4096), one through a
    loop of symbolic links, one whose bytes are not UTF-8 where it must be written as text (tensorboard, JSON,
    the logs), or a place that cannot be written (a read-only or full file system, no permission). ``None`` for
    anything else, whose traceback is wanted."""
    if isinstance(err, OSError) and err.errno in _NAME_ERRNOS:
        name = str(err.filename or "a file it writes")
        shown = name if len(name) <= 120 else f"{name[:60]}...{name[-40:]} ({len(name)} characters)"
        return ConfigError(f"{shown}: {err.strerror} ({_NAME_ERRNOS[err.errno]})")
    if isinstance(err, RuntimeError) and str(err).startswith("Symlink loop from"):  # Path.resolve before 3.13
        return ConfigError(f"{str(err)[:200]} ({_NAME_ERRNOS[errno.ELOOP]})")
    if isinstance(err, UnicodeEncodeError) and any(0xDC80 <= ord(c) <= 0xDCFF for c in str(err.object)):
        # undecodable bytes of a file name or argument, kept as surrogates by Python (PEP 383)
        return ConfigError(
            f"{str(err.object)[:120]!r} holds bytes that are not UTF-8, which tensorboard, JSON and the logs cannot "
            "write; rename it with UTF-8 characters"
        )
    return None


class WorkerKilled(RuntimeError):
    """A worker process died of a signal before it could report (``signum``): SIGKILL is most often the kernel's
    out-of-memory killer, which strikes where the allocator would have said yes."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"killed by signal {signum}")
        self.signum = signum


def allocation_failure(err: BaseException, advice: str) -> MtkError | None:
    """``err`` as one line where an allocation failed (a device's ``OutOfMemoryError``, the CPU allocator's
    refusal), raised here or in a worker of :func:`mtk.spawn.run_distributed` (whose error carries the workers'
    exceptions by rank): sizes past this machine's memory are bad input, not a bug, and the workers' nested
    tracebacks said so in forty lines. ``advice`` says what to make smaller (the command's own options). ``None``
    for anything else, whose traceback is wanted."""
    workers = getattr(err, "errors", None)
    candidates = sorted(workers.items()) if isinstance(workers, dict) else []
    for rank, error in [(None, err), *candidates]:
        torch = sys.modules.get("torch")  # (not imported: nothing of torch's failed)
        lines = str(error).strip().splitlines()
        first = lines[0] if lines else type(error).__name__
        device = torch is not None and isinstance(error, torch.OutOfMemoryError)
        if isinstance(error, WorkerKilled) and error.signum == 9:
            return ConfigError(
                f"rank {rank} was killed (SIGKILL, most likely by the kernel's out-of-memory killer); {advice}"
            )
        if device or (isinstance(error, RuntimeError) and "can't allocate memory" in first):
            first = re.sub(r"^\[enforce fail at [^\]]*\]\s*(err == 0\.\s*)?", "", first)  # c10's check, not news
            where = "" if rank is None else f" on rank {rank}"
            return ConfigError(f"out of memory{where} ({first[:200]}); {advice}")
    return None
