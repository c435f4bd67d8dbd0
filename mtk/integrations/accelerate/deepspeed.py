"""What mtk.Accelerator changes in accelerate's DeepSpeed path (``distributed_type: DEEPSPEED``)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from accelerate.scheduler import AcceleratedScheduler
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from mtk import jsonio
from mtk.config import RunSettings
from mtk.errors import ConfigError
from mtk.integrations.accelerate.scheduler import DataParallelScheduler
from mtk.integrations.deepspeed import check_precision, check_sections, initialization_cleanup, partition_over_replicas
from mtk.integrations.deepspeed_batch import BATCH_FIELDS, dp_layout, reconcile_batch
from mtk.integrations.deepspeed_experts import (
    check_deepspeed_experts,
    follow_param_group_split,
    named_param_groups,
    prepare_experts_for_deepspeed,
    split_client_optimizer,
    spread_experts_seen_as_moe,
)
from mtk.integrations.deepspeed_norm import clip_where_deepspeed_keeps_no_norm
from mtk.integrations.deepspeed_sections import idle_sections
from mtk.parallel.state import ParallelState

__all__ = [
    "check_launcher_sections",
    "deepspeed_initialize_with_mpu",
    "reconcile_accelerate_batch",
    "reconcile_gradient_clipping",
    "refuse_two_optimizers",
    "replace_accelerated_schedulers",
    "scheduler_steps_over_replicas",
    "user_batch_fields",
]


def check_launcher_sections() -> list[str]:
    """The DeepSpeed JSON ``accelerate launch`` names (its YAML's ``deepspeed_config_file``), checked before
    accelerate builds its plugin from it: a section given as another type than an object
    (:func:`~mtk.integrations.deepspeed.check_sections`) was an ``AttributeError`` in accelerate on every rank.
    A missing file is left to accelerate's own message; one that is not JSON is one line naming it (accelerate's
    was its parser's words alone). Returns the lines to say about sections nothing acts on
    (:func:`~mtk.integrations.deepspeed_sections.idle_sections`)."""
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not path or not Path(path).is_file():
        return []
    try:
        raw = jsonio.read(Path(path))
    except json.JSONDecodeError as err:
        if "given twice" in err.msg:  # accelerate would keep the last
            raise ConfigError(f"DeepSpeed config {path}: {err.msg}; give each key once") from None
        raise ConfigError(
            f"DeepSpeed config {path} (the accelerate YAML's) is not valid JSON ({err}); fix the file"
        ) from None
    if not isinstance(raw, dict):
        return []
    check_sections(raw, path)
    return idle_sections(raw, path)


def user_batch_fields(plugin, from_launcher: bool = True) -> tuple[dict[str, Any], str]:
    """The batch fields as the user's DeepSpeed JSON states them, and how messages name it.

    accelerate's plugin writes ``gradient_accumulation_steps: 1`` into a config that has none, which
    would hide that DeepSpeed (and mtk) derive it from ``train_batch_size``: the launcher's file is read
    again (``from_launcher``: the plugin was built from it, not passed in by the script).
    """
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") if from_launcher else None
    if path and Path(path).is_file():
        try:
            raw = jsonio.read(Path(path))
        except json.JSONDecodeError:
            raw = None
        if isinstance(raw, dict):
            return {key: raw[key] for key in BATCH_FIELDS if key in raw}, path
    config = plugin.deepspeed_config
    return {key: config[key] for key in BATCH_FIELDS if key in config}, "the DeepSpeed config"


def reconcile_gradient_clipping(config: dict[str, Any], settings: RunSettings, where: str) -> RunSettings:
    """Under DeepSpeed the engine clips inside its step by the config's ``gradient_clipping``, and accelerate's
    ``clip_grad_norm_`` only returns the norm: a script's own value (``RunSettings.gradient_clipping``: its
    ``--max_grad_norm``, else ``megatron_lm_gradient_clipping``) was dropped without a word. It is written into a
    ``config`` that leaves the field ``"auto"`` or out (accelerate would fill 1.0); a number there that differs is
    one line; with no value of the run's, the settings take the config's, so the script clips by the same one.
    Returns the settings."""
    given = config.get("gradient_clipping")  # (accelerate's YAML gradient_clipping already filled into an "auto")
    mine = settings.gradient_clipping or None
    if given in (None, "auto"):
        if mine is not None:
            config["gradient_clipping"] = mine
        return settings
    if mine is None:
        return replace(settings, gradient_clipping=float(given))
    if float(given) != mine:
        raise ConfigError(
            f'{where}: "gradient_clipping": {given} disagrees with this run\'s gradient clipping {mine} '
            "(--max_grad_norm, else megatron_lm_gradient_clipping), and DeepSpeed clips by its config inside its "
            'step: give the same value, or "auto" in the config to take the run\'s'
        )
    return settings


def reconcile_accelerate_batch(accelerator, args: tuple, explicit_accumulation: int | None) -> None:
    """Before accelerate prepares a model under DeepSpeed: the JSON's batch fields reconciled with the
    DataLoader's ``batch_size`` and ``Accelerator(gradient_accumulation_steps=...)`` by
    :func:`~mtk.integrations.deepspeed_batch.reconcile_batch` (DP from mtk's topology), written into the
    plugin's config, and accelerate's own accumulation count (what ``accumulate`` and ``sync_gradients``
    follow) set to the engine's."""
    if not any(isinstance(obj, nn.Module) for obj in args):
        return
    plugin, parallel = accelerator.state.deepspeed_plugin, accelerator.parallel
    sizes = [obj.batch_size for obj in args if isinstance(obj, DataLoader) and obj.batch_size is not None]
    micro = (min(sizes) if plugin.is_train_batch_min else max(sizes)) if sizes else None
    if micro is not None and accelerator.split_batches:
        micro //= parallel.dp_size
    fields, where = accelerator.deepspeed_batch_fields
    batch, note = reconcile_batch(
        fields,
        parallel.dp_size,
        micro_batch_size=micro,
        accumulation=explicit_accumulation,
        micro_flag="the DataLoader's batch_size {}",
        accumulation_flag="Accelerator(gradient_accumulation_steps={})",
        where=where,
        layout=dp_layout(parallel.world_size, parallel.tp_size, parallel.pp_size, parallel.cp_size),
    )
    if note:
        accelerator.print(note)
    batch.apply(plugin.deepspeed_config)
    accelerator.gradient_accumulation_steps = batch.accumulation


def refuse_two_optimizers(accelerator, args: tuple) -> None:
    """One line where accelerate raises a ``ValueError`` inside ``prepare`` (a traceback on every rank): the JSON has
    an ``optimizer`` (or ``scheduler``) block and the script passes its own optimizer (or LR scheduler) too."""
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    where = accelerator.deepspeed_batch_fields[1]
    for block, kind, dummy in (("optimizer", Optimizer, "DummyOptim"), ("scheduler", LRScheduler, "DummyScheduler")):
        if block in config and any(isinstance(obj, kind) for obj in args):
            raise ConfigError(
                f'{where} defines the {block} (its "{block}" block) and the script prepares its own too; remove the '
                f"block from the JSON, or pass accelerate.utils.{dummy} in the script"
            )


@contextmanager
def scheduler_steps_over_replicas(accelerator, args: tuple) -> Iterator[None]:
    """accelerate fills a ``DummyScheduler``'s ``total_num_steps`` into the JSON's scheduler divided by its number of
    processes (each a replica in plain accelerate); the replicas are the DP ranks, so a TP 2 run's schedule ended at
    half its steps and stayed at its last rate. Inside, each such scheduler's count is scaled so that accelerate's
    division is by dp: ``ceil(T x k / (dp x k)) = ceil(T / dp)``, ``k = tp x cp x pp``."""
    from accelerate.utils import DummyScheduler

    factor = accelerator.num_processes // accelerator.parallel.dp_size
    scaled = [
        obj
        for obj in args
        if isinstance(obj, DummyScheduler) and obj.total_num_steps is not None and not accelerator.split_batches
    ]
    for scheduler in scaled:
        scheduler.total_num_steps *= factor
    try:
        yield
    finally:
        for scheduler in scaled:
            scheduler.total_num_steps //= factor


@contextmanager
def deepspeed_initialize_with_mpu(parallel: ParallelState, where: str) -> Iterator[None]:
    """accelerate calls ``deepspeed.initialize`` without an mpu; with mtk's topology as the mpu ZeRO
    shards over the DP group only (the batch fields were reconciled by :func:`reconcile_accelerate_batch`).
    fp16 where DeepSpeed has none, and a config DeepSpeed refuses, are one line; a failure removes the
    job's shared-memory buffers."""
    import deepspeed

    original = deepspeed.initialize

    def initialize(*args, **kwargs):
        config = kwargs.get("config_params") or kwargs.get("config")
        if isinstance(config, dict):
            config.pop("mtk", None)
            check_precision(config, where, accelerate=True)
            check_deepspeed_experts(config, parallel, where)
        kwargs["mpu"] = parallel
        spread = prepare_experts_for_deepspeed(kwargs["model"], parallel) is not None
        if spread and isinstance(kwargs.get("optimizer"), Optimizer):
            split_client_optimizer(kwargs["optimizer"])
        elif spread and kwargs.get("model_parameters") is not None:  # the JSON's optimizer (accelerate's DummyOptim)
            kwargs["model_parameters"] = named_param_groups(kwargs["model_parameters"])
        with initialization_cleanup(where), spread_experts_seen_as_moe() if spread else contextlib.nullcontext():
            if isinstance(config, dict):
                partition_over_replicas(kwargs["model"], config, parallel)  # ZeRO-3 at CP > 1: over DP x CP
            initialized = original(*args, **kwargs)
        clip_where_deepspeed_keeps_no_norm(initialized[0], parallel)  # ZeRO-0 fp32: the norm accelerate returns
        return initialized

    deepspeed.initialize = initialize
    try:
        yield
    finally:
        deepspeed.initialize = original


def replace_accelerated_schedulers(accelerator, prepared):
    """A torch scheduler DeepSpeed does not own is stepped by accelerate once per process; under TP
    it must step once per DP replica, as everywhere else in mtk."""
    single = not isinstance(prepared, tuple)
    items = [prepared] if single else list(prepared)
    for i, obj in enumerate(items):
        if isinstance(obj, AcceleratedScheduler):
            follow_param_group_split(obj.scheduler)  # the optimizer's experts took groups of their own (EP)
        if type(obj) is AcceleratedScheduler:
            replacement = DataParallelScheduler(
                obj.scheduler,
                obj.optimizers,
                step_with_optimizer=obj.step_with_optimizer,
                split_batches=obj.split_batches,
                dp_size=accelerator.parallel.dp_size,
            )
            accelerator._schedulers = [replacement if s is obj else s for s in accelerator._schedulers]
            items[i] = replacement
    return items[0] if single else tuple(items)
