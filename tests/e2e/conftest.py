"""Runs shared by the e2e tests, launched once per test session (once per worker under ``-n``).

The deterministic reference runs (the built-in tiny Llama on the bundled data, seed 0) are what many
tests compare against: at TP=1 and TP=2, 6 steps, checkpoints at steps 3 and 6. Tests read their
directories (resume, export, reshard) but never write into them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.launch import finetune


@dataclass(frozen=True)
class Run:
    """A finished training run: its output directory (``step_3``, ``step_6``, ``runs``) and losses."""

    dir: Path
    losses: dict[int, float]


def _reference(tmp_path_factory, config: str) -> Run:
    out_dir = tmp_path_factory.mktemp(config)
    return Run(out_dir, finetune(config, out_dir, "--max_steps", "6", "--save_every", "3"))


@pytest.fixture(scope="session")
def llama_tp1(tmp_path_factory) -> Run:
    """The single-process reference every layout must reproduce."""
    return _reference(tmp_path_factory, "tp1")


@pytest.fixture(scope="session")
def llama_tp2(tmp_path_factory) -> Run:
    """The same run at TP=2 (the README's main command, shortened)."""
    return _reference(tmp_path_factory, "tp2")
