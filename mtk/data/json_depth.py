"""How deeply a JSON file nests, read before pyarrow's JSON reader (under ``datasets``) sees it.

pyarrow's reader recurses once per nesting level: a ``--data`` row nested 30,000 levels deep overflows its stack and
the process dies of SIGSEGV, with no line and no traceback (10,000 levels read fine). :func:`check_json_depth` finds
the deepest point of a file in one vectorized pass (brackets inside strings, escaped quotes included, do not count),
so such a file is one line naming it instead.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mtk.errors import DataError

__all__ = ["MAX_JSON_DEPTH", "check_json_depth", "json_depth", "json_lines_depth"]

MAX_JSON_DEPTH = 5_000  # far past any data row, well before pyarrow's stack gives out
_CHUNK = 4 << 20  # bytes a pass reads at once (its arrays take ~40x that)
_LINES_CHUNK = 64 << 10  # bytes of lines counted at once (small: few runs of lines hold the limit's brackets)
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def json_depth(path: Path) -> int:
    """The deepest nesting of ``[`` and ``{`` in the JSON file ``path``, outside strings (one pass over it all)."""
    scan = _Scan()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_CHUNK), b""):
            scan.feed(block)
    return scan.deepest


def json_lines_depth(path: Path) -> int:
    """:func:`json_depth` of a JSON lines file, where every line starts outside any bracket and string: a run of
    whole lines with no more opening brackets than :data:`MAX_JSON_DEPTH` cannot nest deeper, and is skipped at the
    speed of ``bytes.count``; only the others are scanned (each from its first line). Returns the deepest level
    found where it passes the limit, else at most the limit."""
    deepest = 0
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_LINES_CHUNK) + handle.readline(), b""):  # whole lines
            opening = block.count(b"[") + block.count(b"{")
            if opening <= MAX_JSON_DEPTH:
                deepest = max(deepest, min(opening, MAX_JSON_DEPTH))
                continue
            scan = _Scan()
            for start in range(0, len(block), _CHUNK):  # a long line in pieces: the arrays stay ~40x _CHUNK
                scan.feed(block[start : start + _CHUNK])
            deepest = max(deepest, scan.deepest)
    return deepest


class _Scan:
    """The depth of a stream of JSON bytes fed in blocks (its state carried from one block to the next)."""

    def __init__(self) -> None:
        self.deepest = self.depth = 0
        self.in_string = False
        self.backslashes = 0  # the run of backslashes that ended the previous block

    def feed(self, block: bytes) -> None:
        chars = np.frombuffer(block, np.uint8)  # [n]
        if not chars.size:
            return
        escaped = _escaped(chars, self.backslashes)  # [n] bool: preceded by an odd run of backslashes
        quotes = (chars == _QUOTE) & ~escaped
        # inside a string: an odd number of unescaped quotes before this character (the quote itself toggles)
        toggles = np.cumsum(quotes) + int(self.in_string)  # [n]
        outside = (toggles - quotes) % 2 == 0
        step = np.isin(chars, _OPEN).astype(np.int64) - np.isin(chars, _CLOSE)  # [n]: +1, -1 or 0
        levels = self.depth + np.cumsum(np.where(outside, step, 0))  # [n]
        self.deepest = max(self.deepest, int(levels.max()))
        self.depth = int(levels[-1])
        self.in_string = bool(toggles[-1] % 2)
        self.backslashes = _trailing_backslashes(chars, self.backslashes)


def _escaped(chars: np.ndarray, carried: int) -> np.ndarray:
    """Whether each character follows an odd run of backslashes (``carried``: the run ending the previous chunk)."""
    index = np.arange(chars.size)
    slash = chars == _BACKSLASH
    # the index of the last character before each position that is no backslash (-1 - carried: the run goes back)
    last_other = np.maximum.accumulate(np.where(slash, -1 - carried, index))  # [n]
    before = np.concatenate(([-1 - carried], last_other[:-1]))  # [n]: for position i, over positions < i
    run = index - 1 - before  # backslashes right before each position
    return run % 2 == 1


def _trailing_backslashes(chars: np.ndarray, carried: int) -> int:
    """The run of backslashes that ends ``chars`` (continuing ``carried`` where all of it is backslashes)."""
    others = np.flatnonzero(chars != _BACKSLASH)
    return chars.size - 1 - int(others[-1]) if others.size else carried + chars.size


def check_json_depth(path: Path, option: str) -> None:
    """One line where the JSON (``.json``) or JSON lines (``.jsonl``) file ``path`` nests deeper than
    :data:`MAX_JSON_DEPTH` levels."""
    depth = json_lines_depth(path) if path.suffix.lower() == ".jsonl" else json_depth(path)
    if depth > MAX_JSON_DEPTH:
        raise DataError(
            f"{option} {path} nests {depth} levels deep, more than the {MAX_JSON_DEPTH} mtk reads (the JSON reader "
            "would overflow its stack); flatten the rows"
        )
