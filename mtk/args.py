"""Command-line checks shared by the training scripts: values are checked as they are parsed, and a bad
one is one line from one rank (``prog: error: ...``), not a usage dump from every process."""

from __future__ import annotations

import argparse
import math
from datetime import timedelta
from typing import NoReturn

from mtk.errors import ConfigError

__all__ = [
    "ArgumentParser",
    "add_recompute_argument",
    "add_safety_arguments",
    "collective_timeout",
    "directory",
    "finite_float",
    "seed",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "utf8_text",
]


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are :class:`ConfigError` (so ``run_main`` reports them once)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see --help)")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def directory(text: str) -> str:
    """A directory option (``--output_dir``): an empty one would write into whatever folder the run starts in."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; give a directory (e.g. ckpts)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # bytes Python kept as surrogates: tensorboard's event files could not be named
        raise argparse.ArgumentTypeError(f"{text!r} holds bytes that are not UTF-8; use a UTF-8 name") from None
    return text


def utf8_text(text: str) -> str:
    """A text option (a prompt): bytes that are not UTF-8, which Python keeps as surrogates, reach a tokenizer as
    text it cannot encode (a traceback from deep inside it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"{text!r} holds bytes that are not UTF-8; give UTF-8 text") from None
    return text


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def seed(text: str) -> int:
    """A random seed numpy and torch both take: 0 to 2**32 - 1 (numpy's range; torch.manual_seed takes more)."""
    value = _int(text)
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be a seed from 0 to {2**32 - 1}, got {value}")
    return value


FLOAT32_MAX = 3.4028234663852886e38


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:  # 1e39 is inf in an fp32 update
        raise argparse.ArgumentTypeError(f"must be a finite fp32 number, got {text}")
    return value


def positive_float(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def add_safety_arguments(parser: argparse.ArgumentParser, *, can_skip_steps: bool = True) -> None:
    """``--skip_nonfinite`` (where the script can skip a step) and ``--distributed_timeout_minutes``, as every
    training script spells them."""
    if can_skip_steps:
        parser.add_argument(
            "--skip_nonfinite",
            action="store_true",
            help="skip an optimizer step whose gradient norm is inf/nan (default: stop the run before it is saved)",
        )
    parser.add_argument(
        "--distributed_timeout_minutes",
        type=positive_float,
        default=10.0,
        help="how long a collective waits for a rank that died or hangs before the run stops (default 10, "
        "as Megatron-LM's)",
    )


def collective_timeout(args: argparse.Namespace) -> timedelta:
    """``--distributed_timeout_minutes`` as the timeout of the job's process groups."""
    return timedelta(minutes=args.distributed_timeout_minutes)


def add_recompute_argument(parser: argparse.ArgumentParser) -> None:
    """``--gradient_checkpointing``: HF's name for full recompute of every block (:mod:`mtk.parallel.recompute`)."""
    parser.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="recompute each block's activations in backward (full recompute; default: megatron_lm_recompute_*)",
    )
