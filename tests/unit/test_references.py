"""Every file and module that mtk's docstrings, messages and docs name exists.

Paths (``mtk/...py``, ``docs/...md``, ``examples/...``, ``accelerate_configs/...yaml`` ...), markdown
links, and dotted names (``mtk.convert.parallelize``) are resolved against the repository and the
importable package. A renamed module or moved section then fails here, not in a user's hands.
"""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    [*ROOT.glob("mtk/**/*.py"), *ROOT.glob("examples/**/*.py"), *ROOT.glob("examples/**/*.md")]
    + [*ROOT.glob("docs/*.md"), ROOT / "README.md"]
)
PATH = re.compile(
    r"(?<![\w/.])((?:mtk|docs|tests|examples|accelerate_configs|ds_configs)/[\w/.\-]*\.(?:py|md|yaml|json))(?![\w])"
)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
DOTTED = re.compile(r"(?<![\w.])(mtk(?:\.[A-Za-z_]\w*)+)")


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def _references(path: Path):
    text = path.read_text()
    for match in PATH.finditer(text):
        yield "path", match.group(1), ROOT
    if path.suffix == ".md":
        for match in LINK.finditer(text):
            if "://" not in match.group(1):
                yield "link", match.group(1), path.parent
    for match in DOTTED.finditer(text):
        name = match.group(1).rstrip(".")
        if not name.endswith((".py", ".md")):
            yield "name", name, None


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_reference_exists(source):
    broken = []
    for kind, target, base in _references(source):
        if kind == "name":
            ok = _resolves(target)
        else:
            ok = (base / target).exists()
        if not ok:
            broken.append(f"{kind} {target}")
    assert broken == [], f"{source.relative_to(ROOT)} names what does not exist: {sorted(set(broken))}"
