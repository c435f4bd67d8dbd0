"""JSON from files a user or an attacker wrote (checkpoint metadata, model indexes, DeepSpeed configs).

Python's parser recurses once per nesting level: a file of 100,000 nested brackets raised ``RecursionError`` past
every handler that turns malformed JSON into one line. :func:`loads` makes it a ``json.JSONDecodeError`` like any
other malformed JSON, so each reader's own message names the file.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["loads"]


def loads(text: str | bytes) -> Any:
    """``json.loads``; nesting too deep to parse is a ``json.JSONDecodeError``."""
    try:
        return json.loads(text)
    except RecursionError:
        document = text if isinstance(text, str) else text.decode("utf-8", errors="replace")
        raise json.JSONDecodeError("nested too deeply to parse", document[:80], 0) from None
