"""JSON from files a user or an attacker wrote (checkpoint metadata, model indexes, DeepSpeed configs).

Python's parser recurses once per nesting level: a file of 100,000 nested brackets raised ``RecursionError`` past
every handler that turns malformed JSON into one line. :func:`loads` makes it a ``json.JSONDecodeError`` like any
other malformed JSON, so each reader's own message names the file. A key written twice in one object is malformed
too (Python keeps the last silently; DeepSpeed refuses it in its config): in a safetensors header, a second entry
under one name can alias another tensor's bytes past every shape check.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["loads"]


def loads(text: str | bytes) -> Any:
    """``json.loads``; nesting too deep to parse, or a key given twice in one object, is a ``json.JSONDecodeError``."""
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
