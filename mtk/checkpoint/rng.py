"""Every rank's random-number generator states in a checkpoint (python, numpy, torch, the device's)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from mtk.checkpoint.meta import CheckpointMeta
from mtk.checkpoint.paths import CheckpointPaths, reading
from mtk.parallel.state import ParallelState

__all__ = ["check_restorable", "restore_rng", "rng_state", "set_rng_state"]


def rng_state(extra: dict[str, Any]) -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = cast(tuple, np.random.get_state(legacy=True))
    states = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.copy()), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
        **extra,
    }
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if accelerator is not None:
        states["device"] = torch.get_device_module(accelerator.type).get_rng_state_all()
    return states


def set_rng_state(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(states["torch"])
    if "device" in states:
        accelerator = torch.accelerator.current_accelerator()
        assert accelerator is not None, "the checkpoint has device RNG states but this machine has no accelerator"
        torch.get_device_module(accelerator.type).set_rng_state_all(states["device"])


def restore_rng(paths: CheckpointPaths, meta: CheckpointMeta, parallel: ParallelState) -> dict[str, Any]:
    """Set this rank's RNG states from the checkpoint: its own rank's at the same rank grid, rank 0's on every rank
    at another. The grid decides, not the world size: at TP 2 x PP 2 resumed at TP 4, rank r's old states are
    another stage's, and the ranks of one replica must draw the same replicated-region dropout (they stopped at
    the first step with a check that blamed the data). The experts' layout moves no rank of a replica."""
    grid = (meta.topology.world_size, meta.topology.tp_size, meta.topology.pp_size, meta.topology.cp_size)
    same_grid = grid == (parallel.world_size, parallel.tp_size, parallel.pp_size, parallel.cp_size)
    path = paths.rng(parallel.rank if same_grid else 0)
    with reading(path):
        rng = torch.load(path, weights_only=True)
        set_rng_state(rng)
    return rng


def check_restorable(path: Path) -> None:
    """What ``mtk verify-checkpoint`` checks of an RNG file without training: its states set as resume sets them
    (this process's own are put back after); one line naming the file otherwise. A device's states are left out:
    verify runs on any machine."""
    with reading(path):
        states = torch.load(path, weights_only=True)
        if not isinstance(states, dict):
            raise TypeError(f"an RNG state is a dict, this is a {type(states).__name__}")
        own = rng_state({})
        try:
            set_rng_state({key: value for key, value in states.items() if key != "device"})
        finally:
            set_rng_state(own)
