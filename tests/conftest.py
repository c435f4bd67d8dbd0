"""Markers by directory: ``unit`` (one process), ``distributed`` (gloo process groups spawned by the
test), ``e2e`` (the used-by commands as subprocesses: accelerate launch, deepspeed, mtk). Select with
``-m``, e.g. ``python -m pytest -m "not e2e"`` for the fast part.

Start-up is what these tests mostly pay for: gloo workers fork from a fork server that imported torch
once (:mod:`mtk.spawn`), the e2e reference runs are session fixtures (``tests/e2e/conftest.py``), and
``-n 2`` runs two files at a time (``--dist loadfile`` keeps a file's module-scoped runs on one worker)."""

from pathlib import Path

import pytest

from mtk import spawn
from tests.e2e import forked

_MARKERS = {"unit": "unit", "distributed": "distributed", "e2e": "e2e", "conformance": "e2e"}

# Seconds per file on 2 cores with the suite's other worker beside it (`pytest -n 2 --durations=0 tests`, summed
# per file); only the order matters, so a stale figure costs balance, never a result.
FILE_SECONDS = {
    "tests/e2e/test_chat_data.py": 457,
    "tests/e2e/test_multinode.py": 414,
    "tests/e2e/test_pipeline_training.py": 409,
    "tests/e2e/test_deepspeed.py": 640,
    "tests/distributed/test_bench.py": 650,
    "tests/e2e/test_signals.py": 240,
    "tests/e2e/test_memory_features.py": 334,
    "tests/e2e/test_faults.py": 324,
    "tests/e2e/test_finetune.py": 277,
    "tests/e2e/test_examples.py": 242,
    "tests/distributed/test_plan_check.py": 188,
    "tests/e2e/test_trl.py": 330,
    "tests/e2e/test_trainers.py": 220,
    "tests/e2e/test_tp_plan_rules_training.py": 106,
    "tests/e2e/test_trl_lora.py": 200,
    "tests/e2e/test_lora.py": 67,
    "tests/e2e/test_own_loop.py": 60,
    "tests/conformance/test_accelerate_scripts.py": 52,
    "tests/e2e/test_verify_cli.py": 48,
}
FOLDER_SECONDS = {"e2e": 40, "conformance": 40, "distributed": 20, "unit": 1}


def _seconds(item: pytest.Item) -> float:
    path = Path(str(item.fspath))
    relative = path.relative_to(Path(__file__).resolve().parent.parent).as_posix()
    return FILE_SECONDS.get(relative, FOLDER_SECONDS.get(path.parent.name, 1))


def pytest_configure(config: pytest.Config) -> None:
    spawn.preload(*forked.PRELOAD)  # before any test starts the fork server
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist reorders files by test count: keep this order
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in _MARKERS:
            item.add_marker(_MARKERS[folder])
    items.sort(key=lambda item: -_seconds(item))  # stable: each file's tests keep their order
