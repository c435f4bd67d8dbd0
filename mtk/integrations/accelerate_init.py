"""How ``mtk.Accelerator`` has accelerate form the process group: without NVIDIA's Megatron-LM plugin,
with gloo for DeepSpeed on a CPU, and with the collective timeout the user asked for."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from accelerate.utils import InitProcessGroupKwargs

from mtk.parallel.state import group_timeout

__all__ = ["apply_timeout", "gloo_for_deepspeed", "megatron_plugin_off"]


@contextmanager
def megatron_plugin_off() -> Iterator[None]:
    """accelerate builds its Megatron-LM plugin (NVIDIA's package) when ``accelerate launch`` exported
    ``ACCELERATE_USE_MEGATRON_LM=true``; the megatron_lm_config block is mtk's to interpret, so that
    variable reads "false" while accelerate's constructor runs and is restored afterwards."""
    key, saved = "ACCELERATE_USE_MEGATRON_LM", os.environ.get("ACCELERATE_USE_MEGATRON_LM")
    os.environ[key] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


def _init_handler(handlers: list[Any]) -> InitProcessGroupKwargs | None:
    return next((h for h in handlers if isinstance(h, InitProcessGroupKwargs)), None)


def gloo_for_deepspeed(handlers: list[Any]) -> list[Any]:
    """``kwargs_handlers`` that make accelerate form DeepSpeed's process group with gloo (a CPU has no
    NCCL): the user's ``InitProcessGroupKwargs`` keeps its other fields."""
    handlers = list(handlers)
    init = _init_handler(handlers)
    if init is None:
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    elif init.backend == "nccl":  # accelerate's default value, which no CPU can run
        handlers[handlers.index(init)] = dataclasses.replace(init, backend="gloo")
    return handlers


def apply_timeout(handlers: list[Any]) -> None:
    """Give the world group the collective timeout of the user's ``InitProcessGroupKwargs``.

    accelerate passes on only the fields that differ from the class's defaults, so a timeout equal to
    NCCL's default (600 s) never reaches a gloo group (whose default is 1800 s); mtk's own groups copy
    the world's timeout when they are built.
    """
    init = _init_handler(handlers)
    if init is None or init.timeout is None or not dist.is_initialized():
        return
    if group_timeout() != init.timeout:
        dist.distributed_c10d._set_pg_timeout(init.timeout)
