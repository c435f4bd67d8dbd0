"""Markers by directory: ``unit`` (one process), ``distributed`` (gloo process groups spawned by the
test), ``e2e`` (the used-by commands as subprocesses: accelerate launch, deepspeed, mtk). Select with
``-m``, e.g. ``python -m pytest -m "not e2e"`` for the fast part.

Start-up is what these tests mostly pay for: gloo workers fork from a fork server that imported torch
once (:mod:`mtk.spawn`), the e2e reference runs are session fixtures (``tests/e2e/conftest.py``), and
``-n 2`` runs two files at a time (``--dist loadfile`` keeps a file's module-scoped runs on one worker)."""

from pathlib import Path

import pytest

_MARKERS = {"unit": "unit", "distributed": "distributed", "e2e": "e2e", "conformance": "e2e"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in _MARKERS:
            item.add_marker(_MARKERS[folder])
