"""``mtk``: dispatch to one module per subcommand. Each module exposes ``add_parser`` and ``run``.

Only the module of the subcommand being run is imported (``mtk plan`` answers in seconds; the others bring
in DeepSpeed, PEFT or the bench's peers); ``mtk --help`` imports them all to list them.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import functools
import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from mtk import __version__
from mtk.args import ArgumentParser
from mtk.errors import MtkError, unusable_name

SUBCOMMANDS = ("bench", "export", "plan", "topology", "verify", "verify-checkpoint")


def _module(name: str):
    return importlib.import_module(f"mtk.cli.{name.replace('-', '_')}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="mtk",
        description="Megatron-style tensor, pipeline and data parallelism for HuggingFace models.",
    )
    parser.add_argument("--version", action="version", version=f"mtk {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name in [only] if only else SUBCOMMANDS:
        _module(name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; bad input is one line and exit status 2, a Ctrl-C one line and 130 (the shell's status
    for a program SIGINT stopped). The package imports nothing heavy before this runs (``mtk/__init__.py``), so
    the subcommand's imports are inside it too."""
    previous = sys.unraisablehook
    sys.unraisablehook = functools.partial(_interrupt_again, previous)
    try:
        return _main(argv)
    except KeyboardInterrupt:  # what a command leaves is already cleaned (export stages, saves are atomic)
        _close_progress_bars()
        print(INTERRUPTED, file=sys.stderr)
        return 130
    finally:
        sys.unraisablehook = previous


def _interrupt_again(previous: Callable[[Any], Any], unraisable: Any) -> None:
    """``sys.unraisablehook``: a Ctrl-C that lands in code Python cannot raise from (a weakref callback, a
    ``__del__``: a thread pool's, collected as an export ends) was printed as "Exception ignored ... Traceback" and
    lost, and the command went on. It is delivered to the main thread again, where :func:`main` says it in one line."""
    if isinstance(unraisable.exc_type, type) and issubclass(unraisable.exc_type, KeyboardInterrupt):
        _thread.interrupt_main()
        return
    previous(unraisable)


INTERRUPTED = "mtk: interrupted (SIGINT); stopped, nothing half-written is left"


def _close_progress_bars() -> None:
    """Close the progress bars the interrupt stopped mid-line (transformers' loading bar, the export's), so the line
    that follows is a line of its own rather than the end of a bar's."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # a stream already closed
            bar.close()


def _stop_while_starting(signum: int, frame: object) -> None:
    """SIGINT while the subcommand's modules import: leave at once (nothing is written yet). A KeyboardInterrupt
    raised inside a library's import can leave it half-imported, whose next use fails another way (numpy's lazy
    ``dtypes`` recursed without end), so none is raised there."""
    print(INTERRUPTED, file=sys.stderr, flush=True)
    os._exit(130)


@contextlib.contextmanager
def _starting() -> Iterator[None]:
    """:func:`_stop_while_starting` as the SIGINT handler for the block (in the main thread; elsewhere as is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _stop_while_starting)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        with _starting():
            parser = build_parser(command if command in SUBCOMMANDS and "--help" not in argv[:1] else None)
            args = parser.parse_args(argv)
    except MtkError as err:  # a malformed option: one line, as for every other bad input
        print(f"mtk: error: {err}", file=sys.stderr)
        return 2
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.run(args) or 0
    except MtkError as err:  # bad input: one line, no traceback
        print(f"mtk {args.command}: error: {err}", file=sys.stderr)
        return 2
    except (OSError, UnicodeEncodeError, RuntimeError) as err:  # a path the file system cannot take: one line too
        unusable = unusable_name(err)
        if unusable is None:
            raise
        print(f"mtk {args.command}: error: {unusable}", file=sys.stderr)
        return 2


def console() -> None:
    """The ``mtk`` command: :func:`main`, whose status is the process's. After a Ctrl-C the process leaves without the
    interpreter's teardown (its line and files are out by then): a thread torch or a loader still ran would abort
    the teardown ("terminate called without an active exception", SIGABRT instead of status 130). A command that
    finished ignores a Ctrl-C during the teardown: its work is done, and the interrupt would only print a traceback
    from whichever exit handler it landed in. Output into a pipe its reader closed (``mtk plan ... | head``) ends
    quietly, as ``ls | head`` does."""
    try:
        code = main()
    except BrokenPipeError:  # the reader is gone: nothing more to say, and a flush at exit would raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)  # the shell's status for a program SIGPIPE stopped
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    console()
