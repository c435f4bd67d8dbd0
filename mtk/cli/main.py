"""``mtk``: dispatch to one module per subcommand. Each module exposes ``add_parser`` and ``run``.

Only the module of the subcommand being run is imported (``mtk plan`` answers in seconds; the others bring
in DeepSpeed, PEFT or the bench's peers); ``mtk --help`` imports them all to list them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from mtk import __version__
from mtk.args import ArgumentParser
from mtk.errors import MtkError

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
    try:
        return _main(argv)
    except KeyboardInterrupt:  # what a command leaves is already cleaned (export stages, saves are atomic)
        print("mtk: interrupted (SIGINT); stopped, nothing half-written is left", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in SUBCOMMANDS and "--help" not in argv[:1] else None)
    try:
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


def console() -> None:
    """The ``mtk`` command: :func:`main`, whose status is the process's. After a Ctrl-C the process leaves without the
    interpreter's teardown (its line and files are out by then): a thread torch or a loader still ran would abort
    the teardown ("terminate called without an active exception", SIGABRT instead of status 130)."""
    code = main()
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console()
