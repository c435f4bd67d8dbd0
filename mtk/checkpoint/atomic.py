"""Write a directory so that it appears complete or not at all.

Everything is written into ``<name>.incomplete``; only when the writer is done is it renamed to
``<name>`` (an existing ``<name>`` is moved aside first and removed only after the rename). A crash
at any point leaves either the old directory or none: never one that looks complete but is not.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_dir", "incomplete_path"]


def incomplete_path(final: Path) -> Path:
    """Where ``final`` is written until it is complete."""
    return final.with_name(final.name + ".incomplete")


@contextmanager
def atomic_dir(final: str | Path, *, owner: bool = True, barrier: Callable[[], None] = lambda: None) -> Iterator[Path]:
    """Yield the ``.incomplete`` directory to write into; publish it as ``final`` on success.

    With several processes writing one directory, ``owner`` is true on exactly one of them (it
    creates, renames and replaces); ``barrier`` synchronizes them before writing starts and after
    everyone is done. The owner removes leftovers of its own interrupted saves (``<final>.incomplete``).
    """
    final = Path(final)
    tmp = incomplete_path(final)
    if owner:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    yield tmp
    barrier()
    if owner:
        if final.exists():
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
    barrier()
