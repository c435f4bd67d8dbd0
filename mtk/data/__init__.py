"""Training data for the examples: local files -> tokenized examples with labels -> packed or padded batches.

:func:`training_data` is what the scripts call; the steps are :func:`load_data` (files, folders,
``save_to_disk``), :func:`tokenize_examples` (TRL's ``text`` / ``messages`` / ``prompt`` + ``completion``
conventions, prompt masking) and :func:`pack` or :class:`PadToLongest`. docs/data.md says what each
format trains on and how the loss is averaged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from datasets import Dataset

from mtk.data.batching import PadToLongest, eval_batches, loss_tokens, pack
from mtk.data.formats import IGNORE_INDEX, LOSS_ON, TokenizeReport, detect_format, tokenize_examples
from mtk.data.sources import FORMATS, load_data
from mtk.data.tokenizers import BYTES, ByteTokenizer, add_tokenizer_argument, tokenizer_for
from mtk.errors import DataError

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "LOSS_ON",
    "BYTES",
    "ByteTokenizer",
    "add_tokenizer_argument",
    "DataError",
    "PadToLongest",
    "TokenizeReport",
    "detect_format",
    "eval_batches",
    "load_data",
    "loss_tokens",
    "pack",
    "pad_id_of",
    "tokenize_examples",
    "tokenizer_for",
    "training_data",
]


def pad_id_of(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its eos id (padding carries no loss and, packed, no attention)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if pad is not None else tokenizer.eos_token_id


def training_data(
    path: str | Path,
    tokenizer: Any,
    seq_len: int,
    *,
    packing: bool = False,
    loss_on: str = "assistant",
    source: str = "--data",
    pad_to_multiple_of: int = 1,
) -> tuple[Dataset, PadToLongest, TokenizeReport]:
    """The dataset to put in a ``DataLoader``, its ``collate_fn``, and a report to log.

    ``pad_to_multiple_of``: padded batches are this many positions long times a whole number (the TP
    size under sequence parallelism; ``seq_len`` must then be a multiple of it too).
    """
    if seq_len % pad_to_multiple_of:
        raise DataError(
            f"--seq_len {seq_len} is not a multiple of {pad_to_multiple_of}: sequence parallelism splits every "
            f"row over the {pad_to_multiple_of} TP ranks; use --seq_len {seq_len - seq_len % pad_to_multiple_of}"
        )
    examples, report = tokenize_examples(load_data(path, source), tokenizer, seq_len, loss_on=loss_on, source=source)
    pad_id = pad_id_of(tokenizer)
    collate = PadToLongest(pad_id, pad_to_multiple_of)
    return (pack(examples, seq_len, pad_id) if packing else examples), collate, report
