"""accelerate's ND layout (``parallelism_config``) and its FSDP2 settings, read for mtk's TP model.

An accelerate user describes FSDP2 next to TP with ``distributed_type: FSDP``, an ``fsdp_config`` block
(``fsdp_version: 2``) and a ``parallelism_config`` block (``dp_replicate_size``, ``dp_shard_size``, ``tp_size``),
or passes ``ParallelismConfig(...)`` to the Accelerator. accelerate itself would then build its own device mesh and
wrap the whole model in FSDP over every process, which cannot hold mtk's TP model; so mtk takes the settings over:
``tp_size`` is mtk's TP, ``dp_shard_size``/``dp_replicate_size`` become FSDP2/HSDP over mtk's data-parallel ranks
(:mod:`mtk.parallel.fsdp`), and every FSDP key ``accelerate launch`` exports is acted on or refused in one line.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from mtk.config import ParallelConfig, parse_bool
from mtk.errors import ConfigError
from mtk.integrations.accelerate.launcher import check_launcher_blocks, launcher_config_file
from mtk.parallel.fsdp import ShardingSettings

__all__ = ["accelerate_fsdp_off", "sharding_from_accelerate"]

_OWNED = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG")


@contextmanager
def accelerate_fsdp_off() -> Iterator[None]:
    """accelerate's own FSDP plugin and device mesh stay unbuilt while its constructor runs (mtk shards the model
    itself, over its data-parallel ranks only); the variables are restored afterwards."""
    saved = {key: os.environ.get(key) for key in _OWNED}
    os.environ.update(dict.fromkeys(_OWNED, "false"))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _true(env: Mapping[str, str], key: str, default: str = "false") -> bool:
    """A boolean the launcher exported; anything but true/false (1/0, ...) is one line naming it."""
    return parse_bool(key, env.get(key, default) or default)


def _fsdp_keys(env: Mapping[str, str], report: Callable[[str], None]) -> tuple[bool, tuple[str, ...]]:
    """``(reshard_after_forward, unit class names)`` from the ``FSDP_*`` variables ``accelerate launch`` exports
    for an ``fsdp_config`` block; every other key is refused (one line) where it asks for something else."""
    if env.get("FSDP_VERSION", "1") != "2":
        raise ConfigError(
            f"fsdp_config: fsdp_version {env.get('FSDP_VERSION', '1')}: mtk shards its TP model with FSDP2; set "
            "fsdp_version: 2"
        )
    refusals = {
        "FSDP_OFFLOAD_PARAMS": "fsdp_offload_params: offloading mtk's sharded parameters to the CPU is not supported",
        "FSDP_ACTIVATION_CHECKPOINTING": "fsdp_activation_checkpointing: mtk recomputes blocks itself, asked by the "
        "script (finetune.py --gradient_checkpointing, TrainingArguments.gradient_checkpointing)",
        "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "fsdp_activation_checkpointing_offload is not supported",
        "FSDP_FORWARD_PREFETCH": "fsdp_forward_prefetch is FSDP1's; FSDP2 prefetches the next unit itself",
    }
    for key, message in refusals.items():
        if _true(env, key):
            raise ConfigError(f"fsdp_config: {message}; remove it")
    strategy = env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()
    if strategy not in ("FULL_SHARD", "1"):
        raise ConfigError(
            f"fsdp_config: fsdp_sharding_strategy {strategy} is FSDP1's; with FSDP2 say it with "
            "fsdp_reshard_after_forward (SHARD_GRAD_OP: false) and parallelism_config's dp_replicate_size "
            "(HYBRID_SHARD)"
        )
    if env.get("FSDP_IGNORED_MODULES"):
        raise ConfigError("fsdp_config: fsdp_ignored_modules is not supported next to mtk's TP; remove it")
    policy = env.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP").upper()
    if policy != "TRANSFORMER_BASED_WRAP":
        raise ConfigError(
            f"fsdp_config: fsdp_auto_wrap_policy {policy}: mtk shards each decoder layer as one unit "
            "(TRANSFORMER_BASED_WRAP); set that, optionally with fsdp_transformer_layer_cls_to_wrap"
        )
    classes = tuple(name.strip() for name in env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").split(",") if name.strip())
    state_dict = env.get("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT").upper()
    if state_dict != "SHARDED_STATE_DICT":
        report(
            f"mtk: fsdp_state_dict_type {state_dict}: save_state writes mtk's sharded, checksummed checkpoint "
            "(one file per TP rank); `mtk export` merges it into a full safetensors model"
        )
    if env.get("FSDP_BACKWARD_PREFETCH"):
        report("mtk: fsdp_backward_prefetch is FSDP1's; FSDP2 prefetches the previous unit in backward itself")
    if _true(env, "FSDP_CPU_RAM_EFFICIENT_LOADING"):  # transformers reads it: ranks but 0 would load no weights
        raise ConfigError(
            "fsdp_config: fsdp_cpu_ram_efficient_loading: true makes transformers' from_pretrained leave every rank "
            "but 0 uninitialised, waiting for a broadcast FSDP2 under mtk does not make (each rank converts the same "
            "weights to its own piece); set it to false"
        )
    if _true(env, "FSDP_SYNC_MODULE_STATES"):
        report(
            "mtk: fsdp_sync_module_states: every rank converts the same weights to its TP shard and keeps its own "
            "piece of it; nothing is broadcast"
        )
    return _true(env, "FSDP_RESHARD_AFTER_FORWARD", "true"), classes


def _check_context_parallel(
    pc: Any, explicit: ParallelConfig | None, env: Mapping[str, str], report: Callable[[str], None]
) -> None:
    """parallelism_config's ``cp_size`` is given once; accelerate's ``cp_comm_strategy`` (its all-gather or
    all-to-all) is not mtk's choice of ring or all-to-all, which ``cp_comm_type`` makes."""
    launcher = ParallelConfig.from_env(env)
    for name, other in (("parallel_config", explicit), ("megatron_lm_context_parallel_size", launcher)):
        if other is not None and other.cp_size > 1 and other.cp_size != pc.cp_size:
            raise ConfigError(
                f"parallelism_config cp_size {pc.cp_size} and {name} {other.cp_size} differ; give the CP size once"
            )
    strategy = env.get("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "allgather")  # accelerate exports its default
    if strategy != "allgather":
        raise ConfigError(
            f"parallelism_config cp_comm_strategy {strategy}: mtk chooses its context-parallel attention with "
            "cp_comm_type (ring p2p or all-to-all a2a: MTK_CP_COMM_TYPE=a2a or --cp_comm_type a2a); remove the key"
        )
    report(
        f"mtk: parallelism_config cp_size {pc.cp_size}: mtk's context parallelism (attention over the CP group by "
        "cp_comm_type, MTK_CP_COMM_TYPE); accelerate's cp_backend and cp_comm_strategy do not apply"
    )


def sharding_from_accelerate(
    parallelism_config: Any,
    explicit: ParallelConfig | None,
    report: Callable[[str], None],
    env: Mapping[str, str] | None = None,
) -> tuple[ParallelConfig | None, ShardingSettings | None]:
    """The TP size and FSDP2 settings accelerate's ``parallelism_config`` (argument, or the launcher's
    ``PARALLELISM_CONFIG_*`` variables) and ``fsdp_config`` describe: ``(parallel_config to use, sharding)``."""
    env = os.environ if env is None else env
    if _true(env, "ACCELERATE_USE_PARALLELISM_CONFIG") or _true(env, "ACCELERATE_USE_FSDP"):
        # a key of either block that accelerate does not know never became a variable: read the launcher's YAML
        check_launcher_blocks(launcher_config_file())
    if parallelism_config is None and _true(env, "ACCELERATE_USE_PARALLELISM_CONFIG"):
        from accelerate.parallelism_config import ParallelismConfig

        try:
            parallelism_config = ParallelismConfig()  # reads the PARALLELISM_CONFIG_* variables
        except ValueError as err:  # accelerate's own checks of the sizes
            raise ConfigError(f"parallelism_config: {err}") from None
    fsdp = _true(env, "ACCELERATE_USE_FSDP")
    if parallelism_config is None:
        if fsdp:
            raise ConfigError(
                "distributed_type FSDP without a parallelism_config block: mtk shards over the data-parallel ranks "
                "that parallelism_config names (dp_shard_size, tp_size); add one, e.g. "
                "accelerate_configs/tp2_fsdp2.yaml"
            )
        return explicit, None
    pc = parallelism_config
    if pc.cp_size > 1:
        _check_context_parallel(pc, explicit, env, report)
    if pc.sp_size > 1:
        raise ConfigError(
            f"parallelism_config: sp_size {pc.sp_size} is DeepSpeed's Ulysses; mtk's sequence parallelism goes with "
            "TP (megatron_lm_sequence_parallelism); set sp_size: 1"
        )
    config = explicit
    if pc.tp_size > 1 or explicit is None:
        if explicit is not None and explicit.tp_size != pc.tp_size:
            raise ConfigError(
                f"parallelism_config tp_size {pc.tp_size} and parallel_config tp_size {explicit.tp_size} differ; "
                "give the TP size once"
            )
        launcher = ParallelConfig.from_env(env)
        if launcher.tp_size > 1 and launcher.tp_size != pc.tp_size:
            raise ConfigError(
                f"parallelism_config tp_size {pc.tp_size} and megatron_lm_tp_degree {launcher.tp_size} differ; "
                "give the TP size once"
            )
        config = ParallelConfig(
            tp_size=pc.tp_size,
            pp_size=explicit.pp_size if explicit else launcher.pp_size,
            cp_size=explicit.cp_size if explicit else launcher.cp_size,
            ep_size=explicit.ep_size if explicit else launcher.ep_size,
            etp_size=explicit.etp_size if explicit else launcher.etp_size,
        )
    if pc.cp_size > 1:
        config = dataclasses.replace(config or ParallelConfig.from_env(env), cp_size=pc.cp_size)
    if pc.dp_shard_size == 1:
        if pc.dp_replicate_size > 1 and not fsdp:
            report(
                f"mtk: parallelism_config dp_replicate_size {pc.dp_replicate_size}: plain data parallelism over "
                "every replica mtk's layout gives (processes / (tp x pp))"
            )
        if fsdp:
            raise ConfigError(
                "distributed_type FSDP with parallelism_config dp_shard_size 1: nothing to shard over; set "
                "dp_shard_size to the data-parallel size, or drop the fsdp_config for plain data parallelism"
            )
        return config, None
    reshard, classes = _fsdp_keys(env, report) if fsdp else (True, ())
    report(
        f"mtk: FSDP2 over data parallelism (parallelism_config dp_shard_size {pc.dp_shard_size} x dp_replicate_size "
        f"{pc.dp_replicate_size}): each TP shard split over {pc.dp_shard_size * pc.cp_size} ranks"
        + (f" (dp_shard_size x cp_size {pc.cp_size}: CP ranks hold the same weights)" if pc.cp_size > 1 else "")
    )
    return config, ShardingSettings(
        dp_shard_size=pc.dp_shard_size,
        dp_replicate_size=pc.dp_replicate_size,
        reshard_after_forward=reshard,
        unit_classes=classes,
    )
