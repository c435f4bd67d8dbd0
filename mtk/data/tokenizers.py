"""Tokenizers for the examples: a model directory's own, ``--tokenizer``'s, or bytes for the built-in configs.

There is no tokenizer hub here, so built-in models use :class:`ByteTokenizer` (UTF-8 bytes + 3
special ids, the 259-token vocabulary of the tiny configs). A local model directory with tokenizer
files uses its own tokenizer through ``AutoTokenizer`` (no remote code), chat template included. A local
model directory without one is refused unless ``--tokenizer`` names one (a directory, or ``bytes``): falling
back to bytes would train a real 32k-vocabulary model on byte ids without a word.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mtk import jsonio
from mtk.errors import DataError

__all__ = ["BYTES", "ByteTokenizer", "add_tokenizer_argument", "directory_tokenizer", "tokenizer_for"]

BYTES = "bytes"  # --tokenizer bytes: the byte tokenizer, asked for by name
_FILES = ("tokenizer.json", "tokenizer_config.json")
_BYTE_FILE = "byte_tokenizer.json"  # what ByteTokenizer.save_pretrained writes, so a saved model names it


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; 256 = bos, 257 = eos, 258 = pad. It has no chat template."""

    vocab_size = 259
    bos_token_id, eos_token_id, pad_token_id = 256, 257, 258
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save_pretrained(self, directory: str | Path) -> None:
        """A one-line record that this directory's model reads bytes (the mapping itself is fixed)."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        record = {"tokenizer": "mtk bytes", "vocab_size": self.vocab_size}
        (Path(directory) / _BYTE_FILE).write_text(json.dumps(record) + "\n")


def add_tokenizer_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tokenizer",
        help="a local tokenizer directory, or 'bytes' (UTF-8 bytes, 259 ids); default: the --model directory's own "
        "(bytes for the built-in configs)",
    )


def tokenizer_source(model_spec: Any, tokenizer: Any) -> Any:
    """What :func:`tokenizer_for` reads for these options, as one value: ``"bytes"`` for the byte tokenizer (asked
    for by name, or a built-in config's default), else the directory it reads (``--tokenizer``, or the model's
    own). Options that are not paths are returned as they are."""
    if not isinstance(model_spec, str) or not (tokenizer is None or isinstance(tokenizer, str)):
        return tokenizer
    source = Path(tokenizer or model_spec)
    if tokenizer == BYTES or (tokenizer is None and not source.is_dir()) or (source / _BYTE_FILE).is_file():
        return BYTES
    return str(source)


def tokenizer_for(model_spec: str, tokenizer: str | None = None, vocab_size: int | None = None) -> Any:
    """``tokenizer`` (a local directory, or ``bytes``) if given; else the model directory's own; the byte tokenizer
    for a built-in config, which is made for it. A model directory without a tokenizer is one line, and so is the
    byte tokenizer on a model whose vocabulary (``vocab_size``) cannot hold its 259 ids."""
    source = Path(tokenizer or model_spec)
    if tokenizer == BYTES or (tokenizer is None and not source.is_dir()) or (source / _BYTE_FILE).is_file():
        if vocab_size is not None and vocab_size < ByteTokenizer.vocab_size:
            raise DataError(
                f"the byte tokenizer's ids go up to {ByteTokenizer.vocab_size - 1} but the model has {vocab_size} "
                f"embeddings; pass --tokenizer DIR with the model's own tokenizer"
            )
        return ByteTokenizer()
    if source.is_dir() and any((source / name).is_file() for name in _FILES):
        return _hf_tokenizer(source, "--tokenizer" if tokenizer is not None else "--model", vocab_size)
    if tokenizer is not None:
        raise DataError(f"--tokenizer {tokenizer} is not a directory with {' or '.join(_FILES)}, nor 'bytes'")
    raise DataError(
        f"--model {model_spec} has no tokenizer ({' or '.join(_FILES)}); pass --tokenizer DIR (a local tokenizer "
        f"directory) or --tokenizer bytes (UTF-8 bytes, for a model trained on them)"
    )


def directory_tokenizer(directory: str | Path, option: str = "--model") -> Any:
    """The tokenizer of a model directory a script hands to transformers or TRL, or one line: none there, one that
    needs custom code (never run: transformers would ask on the terminal, and run it on a 'y'), one transformers
    cannot build."""
    source = Path(directory)
    if not any((source / name).is_file() for name in _FILES):
        raise DataError(f"{option} {source} has no tokenizer ({' or '.join(_FILES)}); give a directory with one")
    return _hf_tokenizer(source, option, None)


def _hf_tokenizer(source: Path, option: str, vocab_size: int | None) -> Any:
    """The directory's tokenizer through transformers, or one line: one that needs code (its ``auto_map``: mtk
    never passes ``trust_remote_code``), one transformers cannot build, or ids the model has no embedding for
    (under TP such an id reads a zero vector instead of failing)."""
    from transformers import AutoTokenizer

    try:
        record = jsonio.read(source / "tokenizer_config.json")
    except (OSError, ValueError):
        record = {}
    if isinstance(record, dict) and record.get("auto_map"):
        raise DataError(
            f"{option} {source}: its tokenizer needs the custom code its auto_map names ({record['auto_map']}); mtk "
            "runs no code from a directory: use a tokenizer transformers ships"
        )
    try:
        loaded = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ImportError) as err:
        lines = str(err).strip().splitlines()
        raise DataError(
            f"{option} {source}: transformers cannot load its tokenizer ({lines[0] if lines else type(err).__name__})"
        ) from None
    if vocab_size is not None and len(loaded) > vocab_size:
        raise DataError(
            f"{option} {source}: its tokenizer has {len(loaded)} ids but the model has {vocab_size} embeddings; use "
            "the model's own tokenizer"
        )
    return loaded
