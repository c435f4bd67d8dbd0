"""Markers by directory: ``unit`` (one process), ``distributed`` (gloo process groups spawned by the
test), ``e2e`` (the used-by commands as subprocesses: accelerate launch, deepspeed, mtk). Select with
``-m``, e.g. ``python -m pytest -m "not e2e"`` for the fast part.

Start-up is what these tests mostly pay for (a fresh interpreter spends ~4 s importing torch, transformers,
accelerate and datasets; a tiny model trains in well under a second): gloo workers fork from a fork server that
imported them once (:mod:`mtk.spawn`), and so do the e2e launches' ranks (:mod:`tests.e2e.forked`: accelerate's
launcher code still builds each rank's environment; the signal, fault and multi-node tests keep real launchers,
and ``MTK_TEST_LAUNCH=subprocess`` makes every launch real). The e2e reference runs are session fixtures
(``tests/e2e/conftest.py``), and ``-n 2`` runs two files at a time, longest first (``--dist loadfile`` keeps a
file's module-scoped runs on one worker)."""

from pathlib import Path

import pytest

from mtk import spawn
from tests.e2e import forked

_MARKERS = {"unit": "unit", "distributed": "distributed", "e2e": "e2e", "conformance": "e2e"}

# Seconds per file on 2 cores with the suite's other worker beside it (`pytest -n 2 --durations=0 tests`, summed
# per file); only the order matters, so a stale figure costs balance, never a result.
FILE_SECONDS = {
    "tests/e2e/test_deepspeed.py": 171,
    "tests/distributed/test_bench.py": 150,
    "tests/e2e/test_signals.py": 96,
    "tests/e2e/test_faults.py": 90,
    "tests/e2e/test_examples.py": 90,
    "tests/e2e/test_multinode.py": 71,
    "tests/e2e/test_trl.py": 58,
    "tests/e2e/test_expert_parallel.py": 48,
    "tests/e2e/test_verify_cli.py": 41,
    "tests/distributed/test_plan_check.py": 40,
    "tests/e2e/test_memory_features.py": 39,
    "tests/e2e/test_chat_data.py": 39,
    "tests/distributed/test_expert_parallel.py": 39,
    "tests/e2e/test_context_parallel.py": 38,
    "tests/e2e/test_trainers.py": 36,
    "tests/distributed/test_lora.py": 26,
    "tests/e2e/test_finetune.py": 25,
    "tests/unit/test_signals_lock.py": 23,
    "tests/e2e/test_lora.py": 20,
    "tests/e2e/test_pipeline_training.py": 16,
}
FOLDER_SECONDS = {"e2e": 10, "conformance": 10, "distributed": 5, "unit": 1}


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
