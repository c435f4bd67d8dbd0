"""Data for the examples: local text files through ``datasets``, tokenized, in fixed-length blocks.

There is no tokenizer hub here, so built-in models use :class:`ByteTokenizer` (UTF-8 bytes + 3
special ids, the 259-token vocabulary of the tiny configs). A local model directory with tokenizer
files uses its own tokenizer through ``AutoTokenizer`` (no remote code).
"""

from __future__ import annotations

from pathlib import Path

import torch
from datasets import Dataset, load_dataset

from mtk.errors import DataError

__all__ = ["ByteTokenizer", "DataError", "causal_lm_blocks", "load_text_files", "tokenizer_for"]

_FORMATS = {".jsonl": "json", ".json": "json", ".txt": "text", ".text": "text", ".csv": "csv"}


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; 256 = bos, 257 = eos, 258 = pad."""

    vocab_size = 259
    bos_token_id, eos_token_id, pad_token_id = 256, 257, 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save_pretrained(self, directory: str | Path) -> None:
        """Nothing to write: the byte mapping is fixed (kept for the save_pretrained idiom)."""


def tokenizer_for(model_spec: str):
    """The model directory's own tokenizer if it has one, else the byte tokenizer."""
    path = Path(model_spec)
    if path.is_dir() and any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    return ByteTokenizer()


def load_text_files(path: str | Path, text_column: str = "text") -> Dataset:
    """A ``datasets`` Dataset from a local .jsonl/.json/.txt/.csv file (or a folder of one kind)."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.suffix in _FORMATS) if path.is_dir() else [path]
    if not files or not all(p.is_file() for p in files):
        raise DataError(f"--data {path} does not exist or holds no .jsonl/.json/.txt/.csv files")
    kinds = {_FORMATS.get(p.suffix) for p in files}
    if None in kinds or len(kinds) > 1:
        raise DataError(f"--data {path}: use files of one kind among {sorted(_FORMATS)}")
    kind = kinds.pop()
    if all(p.stat().st_size == 0 for p in files):
        raise DataError(f"--data {path} is empty; give it at least one {text_column!r} row")
    try:
        dataset = load_dataset(kind, data_files=[str(p) for p in files], split="train")
    except Exception as err:  # datasets' own errors (malformed JSON, an empty file, ...), as one line
        root: BaseException = err
        while root.__cause__ is not None or root.__context__ is not None:  # the parser's own message
            root = root.__cause__ or root.__context__  # type: ignore[assignment]
        reason = str(root).strip().splitlines()[0] if str(root).strip() else type(root).__name__
        raise DataError(f"--data {path} could not be read as {kind} ({reason}); check the file's format") from None
    if text_column not in dataset.column_names:
        raise DataError(f"--data {path} has columns {dataset.column_names}; expected a {text_column!r} column")
    return dataset


def causal_lm_blocks(dataset: Dataset, tokenizer, seq_len: int, text_column: str = "text") -> Dataset:
    """Concatenate the tokenized texts (each ended by eos) and cut them into ``seq_len`` blocks."""
    ids: list[int] = []
    for text in dataset[text_column]:
        ids.extend(tokenizer.encode(text) + [tokenizer.eos_token_id])
    n_blocks = len(ids) // seq_len
    if n_blocks == 0:
        raise DataError(f"the data has {len(ids)} tokens, fewer than one block of --seq_len {seq_len}")
    blocks = torch.tensor(ids[: n_blocks * seq_len]).view(n_blocks, seq_len)  # [n, seq_len]
    return Dataset.from_dict({"input_ids": blocks.tolist()}).with_format("torch")
