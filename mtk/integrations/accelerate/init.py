"""How ``mtk.Accelerator`` has accelerate form the process group: without NVIDIA's Megatron-LM plugin,
with gloo for DeepSpeed on a CPU, with the collective timeout the user asked for, and the TP/PP layout
from the argument, the DeepSpeed JSON or the launcher."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from accelerate.utils import InitProcessGroupKwargs

from mtk.config import ParallelConfig, report_override
from mtk.errors import ConfigError
from mtk.integrations.deepspeed import sizes_from_config
from mtk.parallel.fsdp import ShardingSettings
from mtk.parallel.state import group_timeout

__all__ = [
    "accumulation_from_launcher",
    "apply_timeout",
    "gloo_for_deepspeed",
    "megatron_plugin_off",
    "resolve_topology",
]


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


ACCUMULATION_VARIABLE = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"  # `accelerate launch --gradient_accumulation_steps`


@contextmanager
def accumulation_from_launcher(explicit: int | None, report: Callable[[str], None]) -> Iterator[None]:
    """accelerate takes ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS`` over the ``gradient_accumulation_steps`` its
    constructor is given, without a word; in mtk an explicit value wins over a launcher's variable (as for every
    layout setting), reported in one line: the variable is hidden while accelerate's constructor runs. Not given, the
    variable applies; one that is not a positive integer is one line (accelerate's ``int()`` would raise)."""
    saved = os.environ.get(ACCUMULATION_VARIABLE)
    if saved is None:
        yield
        return
    if not saved.strip().isdecimal() or int(saved) < 1:
        raise ConfigError(f"{ACCUMULATION_VARIABLE}={saved!r} must be a positive integer (micro-batches per step)")
    if explicit is None or explicit == int(saved):
        yield
        return
    report(f"mtk: gradient_accumulation_steps={explicit} (explicit) overrides {ACCUMULATION_VARIABLE}={saved}")
    del os.environ[ACCUMULATION_VARIABLE]
    try:
        yield
    finally:
        os.environ[ACCUMULATION_VARIABLE] = saved


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


def resolve_topology(explicit: ParallelConfig | None, deepspeed_config: dict | None) -> ParallelConfig:
    """The topology: ``parallel_config=`` if given (reporting what it overrides), else the DeepSpeed
    JSON's ``"mtk": {"tensor_parallel_size": N, "context_parallel_size": M}`` under DeepSpeed, else the
    ``MEGATRON_LM_*`` variables."""
    launcher = ParallelConfig.from_env()
    from_json = sizes_from_config(deepspeed_config) if deepspeed_config is not None else {}
    launcher = dataclasses.replace(launcher, **from_json)
    config = explicit or launcher
    if explicit is not None:
        variables = {
            "tp_size": "MEGATRON_LM_TP_DEGREE",
            "pp_size": "MEGATRON_LM_PP_DEGREE",
            "cp_size": "MEGATRON_LM_CONTEXT_PARALLEL_SIZE",
            "ep_size": "MEGATRON_LM_EXPERT_MODEL_PARALLEL_SIZE",
            "etp_size": "MEGATRON_LM_EXPERT_TENSOR_PARALLEL_SIZE",
        }
        for field, variable in variables.items():
            given = field in from_json or os.environ.get(variable, "") != ""  # a default is nothing to override
            if given and getattr(explicit, field) != getattr(launcher, field):
                source = "the DeepSpeed JSON's mtk block" if field in from_json else variable
                report_override(field, getattr(explicit, field), source, getattr(launcher, field))
    if deepspeed_config is not None and config.pp_size > 1:
        raise ConfigError(
            f"pipeline parallelism (pp = {config.pp_size}) does not run under DeepSpeed (its ZeRO cannot partition a "
            "pipeline stage here); to shard parameters, gradients and optimizer state over DP next to a pipeline "
            "(ZeRO-3's job) use FSDP2: a parallelism_config with dp_shard_size next to the pipeline size "
            "(docs/memory.md); or a megatron_lm_config YAML with megatron_lm_use_distributed_optimizer: true to shard "
            "the optimizer state (accelerate_configs/tp2_pp2_dp2_distopt.yaml)"
        )
    return config


def check_expert_parallel(config: ParallelConfig, *, sharding: ShardingSettings | None) -> None:
    """An HSDP whose writing replica would miss experts is one line (docs/moe.md; what DeepSpeed's MoE path cannot
    take next to EP: :func:`~mtk.integrations.deepspeed_experts.check_deepspeed_experts`); the experts' TP
    size (``megatron_lm_expert_tensor_parallel_size``: the TP size or 1) is checked
    by :class:`~mtk.config.ParallelConfig`."""
    if config.ep_size == 1:
        return
    where = f"expert parallelism (ep = {config.ep_size})"
    shard = sharding.dp_shard_size * config.cp_size if sharding is not None else 0
    if sharding is not None and sharding.dp_replicate_size > 1 and shard % config.ep_size:
        # HSDP's first replica writes a checkpoint: every expert must have a holder there
        raise ConfigError(
            f"{where} with HSDP (parallelism_config dp_replicate_size {sharding.dp_replicate_size}) needs the EP "
            f"size to divide the {shard} ranks that shard each parameter (dp_shard_size x cp); use an EP size "
            "dividing it, or dp_replicate_size 1"
        )
