"""One run per ``--output_dir``: a lock file held by the run's main process for as long as it lives.

Two runs writing one folder remove each other's ``step_N.incomplete`` and replace each other's checkpoints.
The main process takes an exclusive ``flock`` on ``<output_dir>/.mtk-run.lock`` before any rank writes there,
and writes who holds it (pid, host, start time) into the file; a second run is refused in one line naming the
first. The kernel releases the lock when the holder exits or is killed (even with SIGKILL), so a crashed,
preempted or requeued job never blocks the next: nothing is left to clean up. The file itself stays (removing
it would let two runs lock two different files of one name).
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import time
from pathlib import Path

from mtk.errors import CheckpointError

__all__ = ["LOCK_NAME", "lock_output_dir", "unlock_output_dir"]

LOCK_NAME = ".mtk-run.lock"

# The locks this process holds, by folder: flock conflicts between two opens in one process too, so a second
# call for the same folder must reuse the first (a script that resolves its start point twice, tests).
_held: dict[Path, int] = {}


def lock_output_dir(output_dir: str | Path) -> bool:
    """Lock ``output_dir`` (created if missing) for this process's lifetime; ``False`` where the filesystem has no
    locks (said once, the run goes on unguarded).

    Raises:
        CheckpointError: another live process holds it (named from the lock file), or the folder is not writable.
    """
    folder = Path(output_dir).resolve()
    if folder in _held:
        return True
    try:
        import fcntl
    except ImportError:  # not Linux/macOS: no flock
        return False
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # never through a link: the record written into it would overwrite whatever file the link names
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise CheckpointError(
                f"cannot use --output_dir {output_dir}: its lock file {LOCK_NAME} is a symbolic link, and mtk writes "
                "its lock record only into a file of its own; remove the link"
            ) from None
        raise CheckpointError(f"cannot use --output_dir {output_dir}: {err.strerror or err}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device in its place
        os.close(fd)
        raise CheckpointError(
            f"cannot use --output_dir {output_dir}: its lock file {LOCK_NAME} is not a regular file; remove it"
        )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "its record not yet written"
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EACCES):
            raise CheckpointError(
                f"--output_dir {output_dir} is in use by another run ({holder}); wait for it to end, stop it, or "
                f"choose another --output_dir"
            ) from None
        print(f"mtk: --output_dir {output_dir}: no file locks here ({err.strerror}); a second run is not detected")
        return False
    record = f"pid {os.getpid()} on host {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, record.encode(), 0)
    _held[folder] = fd  # never closed: the kernel releases the lock when this process ends, however it ends
    return True


def unlock_output_dir(output_dir: str | Path) -> None:
    """Release this process's lock on ``output_dir`` before it exits (a library user running two jobs in turn)."""
    fd = _held.pop(Path(output_dir).resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the only descriptor releases the flock
