"""JSON from files a user or an attacker wrote (checkpoint metadata, model indexes, DeepSpeed configs).

Python's parser recurses once per nesting level: a file of 100,000 nested brackets raised ``RecursionError`` past
every handler that turns malformed JSON into one line. :func:`loads` makes it a ``json.JSONDecodeError`` like any
other malformed JSON, so each reader's own message names the file. A key written twice in one object is malformed
too (Python keeps the last silently; DeepSpeed refuses it in its config): in a safetensors header, a second entry
under one name can alias another tensor's bytes past every shape check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["loads", "read"]


def read(path: str | Path) -> Any:
    """The JSON document in the file ``path`` (:func:`loads`): bytes that are not text are malformed JSON too (a
    ``json.JSONDecodeError``, where ``read_text`` raised ``UnicodeDecodeError`` before any reader's parse)."""
    path = Path(path)
    if path.exists() and not path.is_file():  # (a FIFO blocks the read; a directory is an OSError of its own)
        if not path.is_dir():
            raise _WholeDocumentError("no regular file (a FIFO, socket or device)", "", 0)
    return loads(path.read_bytes())


def loads(text: str | bytes) -> Any:
    """``json.loads``; nesting too deep to parse, a key given twice in one object, or bytes that are not UTF-8 (nor
    the UTF-16 or UTF-32 JSON allows) is a ``json.JSONDecodeError``."""
    if isinstance(text, bytes):
        try:
            text = text.decode(json.detect_encoding(text))
        except UnicodeDecodeError as err:
            raise _WholeDocumentError(f"not text: byte {err.start} is not {err.encoding}", "", 0) from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except (RecursionError, _DuplicateKey) as err:
        document = text if isinstance(text, str) else text.decode("utf-8", errors="replace")
        problem = "nested too deeply to parse"
        if isinstance(err, _DuplicateKey):
            problem = f"key {err.args[0]!r} is given twice"
        raise _WholeDocumentError(problem, document[:80], 0) from None


class _DuplicateKey(Exception):
    pass


class _WholeDocumentError(json.JSONDecodeError):
    """Malformed as a whole, at no one position: its text is the problem alone (not "line 1 column 1")."""

    def __str__(self) -> str:
        return self.msg


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """One JSON object as a dict; a key that appears twice raises."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out
