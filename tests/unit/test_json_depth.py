"""The depth of a JSON data file, read before pyarrow's JSON reader (which dies of SIGSEGV on rows nested 30,000
levels deep): exact outside strings, escaped quotes and backslash runs across block boundaries included."""

import json
import random

import pytest

import mtk.data.json_depth as json_depth_module
from mtk.data.json_depth import MAX_JSON_DEPTH, json_depth, json_lines_depth
from mtk.data.sources import load_data
from mtk.errors import DataError


def _reference(text: str) -> int:
    """A character-by-character parser's deepest level."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _document(rng: random.Random, level: int = 0):
    draw = rng.random()
    if level > 6 or draw < 0.3:
        return rng.choice(["a[b", 'q"uo\\"te[[', "\\\\", 'x\\\\"y{', 3, None])
    if draw < 0.65:
        return [_document(rng, level + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}[": _document(rng, level + 1) for i in range(rng.randint(0, 3))}


@pytest.mark.parametrize("block", [1, 3, 7, 1 << 22], ids=["1-byte", "3-byte", "7-byte", "4-MiB"])
def test_the_depth_is_a_parsers_whatever_the_blocks(tmp_path, monkeypatch, block):
    monkeypatch.setattr(json_depth_module, "_CHUNK", block)
    rng = random.Random(0)
    for case in range(60):
        text = "\n".join(json.dumps(_document(rng)) for _ in range(rng.randint(1, 4))) + "\n"
        (tmp_path / "rows.json").write_text(text)
        assert json_depth(tmp_path / "rows.json") == _reference(text), (case, text)


def test_json_lines_skip_runs_that_cannot_pass_the_limit_and_find_the_deep_row(tmp_path, monkeypatch):
    monkeypatch.setattr(json_depth_module, "_CHUNK", 4096)  # the deep row (60 KB) scanned in pieces
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "a [b] {c}"}\n' * 20_000)  # many brackets, each row two deep
    assert json_lines_depth(rows) <= MAX_JSON_DEPTH
    rows.write_text('{"text": "x"}\n' * 10 + '{"text": "x", "meta": ' + "[" * 30_000 + "]" * 30_000 + "}\n")
    assert json_lines_depth(rows) == 30_001


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_data_nested_past_the_limit_is_one_line_before_the_reader_sees_it(tmp_path, suffix):
    """A --data row nested 30,000 deep: pyarrow's JSON reader overflowed its stack (exit 139, no line)."""
    rows = tmp_path / f"deep{suffix}"
    rows.write_text('{"text": "x"}\n{"text": "x", "meta": ' + "[" * 30_000 + "]" * 30_000 + "}\n")
    with pytest.raises(DataError, match=rf"--data .*deep\{suffix} nests 30001 levels deep, more than the 5000"):
        load_data(rows)
