"""``mtk``: dispatch to one module per subcommand. Each module exposes ``add_parser`` and ``run``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mtk import __version__
from mtk.args import ArgumentParser
from mtk.cli import bench, export, topology, verify, verify_checkpoint
from mtk.errors import MtkError

SUBCOMMANDS = (bench, export, topology, verify, verify_checkpoint)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="mtk",
        description="Megatron-style tensor, pipeline and data parallelism for HuggingFace models.",
    )
    parser.add_argument("--version", action="version", version=f"mtk {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
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


if __name__ == "__main__":
    sys.exit(main())
