"""Run one of accelerate's own distributed test scripts with ``mtk.Accelerator`` in place of accelerate's.

Launched by ``accelerate launch`` from ``test_accelerate_scripts.py``. The script is read from the
installed accelerate (``accelerate/test_utils/scripts/<name>.py``), never copied into this repository;
the ``Accelerator`` its one ``from accelerate[.accelerator] import ...`` line names comes from mtk
instead (``from mtk import Accelerator``), and nothing else changes. ``--skip f,g`` turns those check
functions into no-ops that say so before the script's ``main()`` runs (for checks whose assumptions do
not hold on a layout; the test that passes ``--skip`` says which and why).
"""

import argparse
import re
import sys
from pathlib import Path

import accelerate.test_utils.scripts as scripts

IMPORT_LINE = re.compile(r"^from (?P<module>accelerate(?:\.accelerator)?) import (?P<names>[^(\n]+)$", re.MULTILINE)


def _point_at_mtk(match: re.Match) -> str:
    names = [name.strip() for name in match["names"].split(",")]
    if "Accelerator" not in names:
        return match[0]
    rest = [name for name in names if name != "Accelerator"]
    kept = f"from {match['module']} import {', '.join(rest)}\n" if rest else ""
    return kept + "from mtk import Accelerator"


def patched_source(name: str) -> tuple[Path, str]:
    """The script's source with its Accelerator import pointed at mtk's (exactly one such import)."""
    path = Path(scripts.__file__).parent / f"{name}.py"
    source = path.read_text()
    found = [m for m in IMPORT_LINE.finditer(source) if "Accelerator" in m["names"].replace(" ", "").split(",")]
    if len(found) != 1:
        sys.exit(f"{path}: expected one import of accelerate's Accelerator, found {len(found)}; update this runner")
    return path, IMPORT_LINE.sub(_point_at_mtk, source)


def _skipped(name: str):
    def skip(*args, **kwargs) -> None:
        print(f"conformance: skipped {name}")

    return skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script", help="a script in accelerate/test_utils/scripts, e.g. test_script")
    parser.add_argument("--skip", default="", help="comma-separated check functions of the script to skip")
    args = parser.parse_args()
    path, source = patched_source(args.script)
    namespace = {"__name__": "accelerate_conformance", "__file__": str(path)}
    exec(compile(source, str(path), "exec"), namespace)  # noqa: S102 - the installed accelerate's own test script
    for name in filter(None, args.skip.split(",")):
        if not callable(namespace.get(name)):
            sys.exit(f"{path} has no check function {name!r} to skip; update the conformance test")
        namespace[name] = _skipped(name)
    namespace["main"]()


if __name__ == "__main__":
    main()
