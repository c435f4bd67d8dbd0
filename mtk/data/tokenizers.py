"""Tokenizers for the examples: a model directory's own, or bytes for the built-in configs.

There is no tokenizer hub here, so built-in models use :class:`ByteTokenizer` (UTF-8 bytes + 3
special ids, the 259-token vocabulary of the tiny configs). A local model directory with tokenizer
files uses its own tokenizer through ``AutoTokenizer`` (no remote code), chat template included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["ByteTokenizer", "tokenizer_for"]


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
        """Nothing to write: the byte mapping is fixed (kept for the save_pretrained idiom)."""


def tokenizer_for(model_spec: str) -> Any:
    """The model directory's own tokenizer if it has one, else the byte tokenizer."""
    path = Path(model_spec)
    if path.is_dir() and any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    return ByteTokenizer()
