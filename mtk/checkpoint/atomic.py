"""Write a directory so that it appears complete or not at all, and never remove what mtk did not write.

Everything is written into ``<name>.incomplete``; only when the writer is done (its files fsynced) is it
renamed to ``<name>`` (an existing ``<name>`` is moved aside to ``<name>.old`` first and removed only
after the rename), and the parent directory is fsynced. A crash at any point leaves either the old
directory or none: never one that looks complete but is not.

Both side directories carry a marker file saying mtk made them. A leftover of mtk's own (an interrupted
save) is removed at the next save; one without the marker belongs to someone else and stops the save
with a clear error instead of being deleted.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from mtk import jsonio
from mtk.errors import CheckpointError

__all__ = [
    "MARKER",
    "atomic_dir",
    "check_ours",
    "check_replaceable",
    "holds_checkpoint",
    "removable_checkpoint",
    "fsync_dir",
    "fsync_tree",
    "incomplete_path",
    "is_ours",
    "refuse_link",
    "remove_ours",
    "storage_reason",
    "unlisted_files",
    "write_synced",
]

MARKER = ".mtk-partial"  # inside a directory mtk is writing or replacing; never in a published one


def incomplete_path(final: Path) -> Path:
    """Where ``final`` is written until it is complete."""
    return final.with_name(final.name + ".incomplete")


def is_ours(directory: Path) -> bool:
    """Whether ``directory`` is a side directory mtk created (it holds mtk's marker; a link never is)."""
    return not directory.is_symlink() and (directory / MARKER).is_file()


def check_ours(directory: Path) -> None:
    """Refuse (one line) a side directory mtk did not create."""
    if (directory.exists() or directory.is_symlink()) and not (directory.is_dir() and is_ours(directory)):
        raise CheckpointError(
            f"{directory} exists and was not created by mtk; move it away (mtk writes and replaces its own "
            f"{directory.name} here)"
        )


def remove_ours(directory: Path) -> None:
    """Remove a leftover side directory of mtk's own; refuse (one line) to touch anyone else's."""
    check_ours(directory)
    if directory.exists():
        shutil.rmtree(directory)


def refuse_link(path: Path, what: str = "mtk does not replace or remove links") -> None:
    """One line for a symbolic link where mtk would write or remove a directory: it acts on the link's target
    never, on the link only when it made it, which it never does."""
    if path.is_symlink():
        raise CheckpointError(f"{path} is a symbolic link; {what}: remove the link or use another directory")


def storage_reason(err: BaseException) -> str | None:
    """Why a write failed, when the storage refused it (full, read-only, gone), in any library's words; else
    ``None`` (a bug: keep its traceback). torch reports a failed write as a RuntimeError, safetensors as its own
    error type, the OS as an OSError."""
    if isinstance(err, OSError):
        return err.strerror or str(err)
    if isinstance(err, SafetensorError) or (
        isinstance(err, RuntimeError) and any(s in str(err) for s in ("write failed", "failed writing"))
    ):
        return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return None


def check_replaceable(final: Path) -> None:
    """``final`` may be replaced only if it is empty or a checkpoint (mtk's metadata.json is in it) holding nothing
    its metadata does not list (a user's notes put into it would go with it), and not a link. A ``metadata.json``
    is mtk's when it names an mtk checkpoint format: another tool's file of that name (a ``step_3/`` of an
    evaluation harness) was taken for one, and ``--overwrite`` removed the folder with everything in it."""
    refuse_link(final)
    if final.exists() and not (final.is_dir() and (not any(final.iterdir()) or _mtk_metadata(final) is not None)):
        if holds_checkpoint(final):  # (damaged: mtk cannot tell from it what the folder holds)
            raise CheckpointError(
                f"{final}/metadata.json cannot be read as mtk checkpoint metadata (damaged), so mtk cannot tell what "
                "the folder holds and will not remove it: if it is a checkpoint of yours you no longer want, remove "
                "it yourself; else move it away, or save to another directory"
            )
        metadata = final / "metadata.json"
        regular = metadata.is_file() and not metadata.is_symlink()
        why = " (its metadata.json is another tool's)" if regular else " (its metadata.json is no regular file)"
        why = why if metadata.exists() or metadata.is_symlink() else ""
        raise CheckpointError(
            f"{final} exists and is not an mtk checkpoint{why}; mtk will not replace it: move it away, or save to "
            "another directory"
        )
    unlisted = unlisted_files(final) if final.is_dir() else []
    if unlisted:
        more = f" and {len(unlisted) - 1} more" if len(unlisted) > 1 else ""
        raise CheckpointError(
            f"{final} holds {unlisted[0]}{more}, which its checkpoint does not list; mtk removes only files it "
            "wrote: move them out of it, or save to another directory"
        )


def unlisted_files(folder: Path) -> list[str]:
    """Files under checkpoint ``folder`` that its metadata's file list leaves out, sorted; none for a checkpoint
    that lists no files (format 1) or whose metadata cannot be read (those are read, and refused, elsewhere)."""
    listed = (_mtk_metadata(folder) or {}).get("files")
    if not isinstance(listed, dict) or not listed:
        return []
    found = (path.relative_to(folder).as_posix() for path in folder.rglob("*") if not path.is_dir())
    return sorted(name for name in found if name != "metadata.json" and name not in listed)


def _mtk_metadata(folder: Path) -> dict[str, Any] | None:
    """``folder``'s ``metadata.json`` where it is mtk checkpoint metadata (a regular file holding a JSON object
    that names an ``mtk-checkpoint/N`` format), else ``None``."""
    path = folder / "metadata.json"
    if path.is_symlink() or not path.is_file():  # (a FIFO would block the read)
        return None
    try:
        record = jsonio.read(path)
    except (OSError, ValueError):
        return None
    return record if _names_mtk_format(record) else None


def _names_mtk_format(record: Any) -> bool:
    return isinstance(record, dict) and str(record.get("format", "")).startswith("mtk-checkpoint/")


def removable_checkpoint(folder: Path) -> bool:
    """Whether a rotation may remove ``folder``: its ``metadata.json`` is readable mtk checkpoint metadata. A
    damaged one (or one mtk cannot read) is :func:`holds_checkpoint`'s, to be read and refused, but is not removed:
    mtk cannot tell from it what the folder holds."""
    return _mtk_metadata(folder) is not None


def holds_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds a complete checkpoint of mtk's, to list and resume: its ``metadata.json`` is a
    regular file, not a link, and not another tool's file of that name (readable JSON that names no mtk format: an
    evaluation harness's ``step_3/``). Damaged metadata still counts: reading the checkpoint says what is wrong with
    it. What a rotation or ``--overwrite`` may remove is :func:`removable_checkpoint`'s, stricter."""
    path = folder / "metadata.json"
    if path.is_symlink() or not path.is_file():
        return False
    try:
        return _names_mtk_format(jsonio.read(path))
    except (OSError, ValueError):
        return True


def fsync_dir(path: Path) -> None:
    """Persist a directory's entries (new files, a rename) where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems (and Windows) do not fsync directories
        pass
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (before it is renamed into place)."""
    for path in sorted(root.rglob("*"), reverse=True):  # files before the directories holding them
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        elif path.is_dir():
            fsync_dir(path)
    fsync_dir(root)


def write_synced(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` and fsync it."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _remove_stale_siblings(final: Path) -> None:
    """Leftovers of mtk's own interrupted saves beside ``final`` (e.g. ``step_9.incomplete`` after a crash and
    a resume from ``step_6``): removed at the next save. Only directories with mtk's marker are touched."""
    if not final.parent.is_dir():
        return
    for sibling in final.parent.iterdir():
        if sibling.name.endswith((".incomplete", ".old")) and sibling.is_dir() and is_ours(sibling):
            shutil.rmtree(sibling)


@contextmanager
def atomic_dir(final: str | Path, *, owner: bool = True, barrier: Callable[[], None] = lambda: None) -> Iterator[Path]:
    """Yield the ``.incomplete`` directory to write into; publish it as ``final`` on success.

    With several processes writing one directory, ``owner`` is true on exactly one of them (it
    creates, renames and replaces); ``barrier`` synchronizes them before writing starts and after
    everyone is done. The owner removes leftovers of its own interrupted saves (``<final>.incomplete``
    with mtk's marker) and refuses to remove anyone else's.
    """
    final = Path(final)
    tmp = incomplete_path(final)
    old = final.with_name(final.name + ".old")
    for side in (tmp, old):  # every rank checks (read-only), so all refuse together ...
        check_ours(side)
    check_replaceable(final)
    barrier()  # ... and all have checked before the owner changes anything
    try:
        if owner:
            remove_ours(tmp)
            remove_ours(old)
            _remove_stale_siblings(final)
            tmp.mkdir(parents=True)
            (tmp / MARKER).touch()
        barrier()
        yield tmp
    except (OSError, SafetensorError, RuntimeError) as err:  # a read-only or full disk: one line, whichever rank
        reason = storage_reason(err)
        if reason is None:
            raise
        raise CheckpointError(
            f"cannot write checkpoint {final}: {reason}; the previous checkpoints are untouched "
            f"(choose a writable --output_dir with free space)"
        ) from None
    barrier()
    if owner:
        (tmp / MARKER).unlink()
        if final.exists():
            final.rename(old)
            (old / MARKER).touch()  # from here on it is mtk's to remove, even if this process dies now
            tmp.rename(final)
            fsync_dir(final.parent)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        fsync_dir(final.parent)
    barrier()
