"""How mtk's Trainer meets a DeepSpeed JSON: the JSON checked and its batch fields reconciled with the arguments
before the Accelerator exists, the processes joined with gloo on a machine without an accelerator, and the refusals
transformers raises only once training starts (in ``deepspeed_init``) said in one line, at set-up where it can.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from mtk import jsonio
from mtk.errors import ConfigError
from mtk.integrations.deepspeed_sections import check_sections, idle_sections

__all__ = [
    "check_deepspeed_json",
    "deepspeed_init_in_one_line",
    "deepspeed_processes_on_cpu",
    "derive_global_batch",
    "fill_launchers_deepspeed_config",
    "refuse_deepspeed_disagreements",
    "refuse_replaced_choices",
]


def deepspeed_init_in_one_line(trainer: Any, num_training_steps: int, inference: bool = False) -> Any:
    """transformers' ``deepspeed_init``: from ``train()`` once the step count is known, and from an evaluation
    before any training (``inference``). Its refusals are one line, as the disagreements mtk finds before training
    are (they were transformers' traceback on every rank): a JSON value that disagrees with the arguments (a
    scheduler's ``warmup_num_steps``), and an evaluation before training under ZeRO-1/2."""
    from transformers.integrations import deepspeed as hf_deepspeed

    if inference:  # (its set-up changes the JSON first, whatever follows: train() is refused after it)
        trainer._deepspeed_for_inference = True
    try:
        return hf_deepspeed.deepspeed_init(trainer, num_training_steps=num_training_steps, inference=inference)
    except ValueError as err:
        lines = [line.strip() for line in str(err).splitlines()]
        if lines and lines[0].startswith("ZeRO inference only makes sense with ZeRO Stage 3"):
            raise ConfigError(
                "evaluate() or predict() before train() under DeepSpeed runs ZeRO inference, which transformers "
                "allows at ZeRO stage 3 only: train first, or evaluate under stage 3"
            ) from err
        if not lines or not lines[0].startswith("Please correct the following DeepSpeed config values"):
            raise
        raise _disagreement([line.removeprefix("- ") for line in lines[1:] if line.startswith("- ")]) from err


def fill_launchers_deepspeed_config(args: Any) -> None:
    """DeepSpeed from accelerate's YAML (no ``deepspeed=`` argument): transformers fills the JSON's ``"auto"`` values
    from the arguments only once the Trainer's Accelerator exists (``propagate_args_to_deepspeed``), but mtk's
    Accelerator reconciles the batch fields as it is built; so they are filled here first, as transformers would."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    plugin = args.deepspeed_plugin
    if plugin.hf_ds_config.config.get("zero_optimization", {}).get("stage") == 3:
        raise ConfigError(
            "ZeRO-3 named by accelerate's YAML with transformers' Trainer: pass the JSON to the Trainer instead "
            "(TrainingArguments.deepspeed, --deepspeed FILE), which builds the model for ZeRO-3 as mtk converts it"
        )
    plugin.hf_ds_config = HfTrainerDeepSpeedConfig(plugin.hf_ds_config.config)
    plugin.deepspeed_config = plugin.hf_ds_config.config
    plugin.hf_ds_config.trainer_config_process(args)
    args.hf_deepspeed_config = plugin.hf_ds_config  # (the Trainer then does not fill them again)


def _given_deepspeed_json(args: Any) -> dict[str, Any]:
    """The DeepSpeed JSON as the user wrote it (``TrainingArguments.deepspeed``, a file or a dict, else the file
    accelerate's YAML names), before transformers filled its ``"auto"``s."""
    given = args.deepspeed or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or {}
    if isinstance(given, str):
        try:
            given = jsonio.read(Path(given))
        except json.JSONDecodeError as err:  # (transformers read the file already, keeping the last of two keys)
            raise ConfigError(f"DeepSpeed config {given}: {err.msg}; give each key once") from None
    return given if isinstance(given, dict) else {}


def check_deepspeed_json(args: Any) -> list[str]:
    """``TrainingArguments.deepspeed`` checked as the launchers' JSONs are (keys DeepSpeed reads, sections of the
    right type, a ZeRO stage of 0-3: ``"stage": true`` trained as ZeRO-1 unsaid); the lines about sections nothing
    acts on. The file accelerate's YAML names is checked where mtk's Accelerator is made."""
    where = args.deepspeed if isinstance(args.deepspeed, str) else "TrainingArguments.deepspeed"
    given = _given_deepspeed_json(args)
    check_sections(given, where)
    return idle_sections(given, where)


def derive_global_batch(args: Any) -> None:
    """An ``"auto"`` ``train_batch_size`` is left for mtk to derive. transformers fills it with world size x
    micro-batch x accumulation when the arguments are made, before any layout is known; under TP and PP only the
    data-parallel replicas multiply the batch, which mtk's DeepSpeed set-up derives from the other two fields."""
    given = _given_deepspeed_json(args)
    if given.get("train_batch_size", "auto") != "auto":
        return  # the user's number: mtk checks it against the layout (one line if it disagrees)
    for config in (
        getattr(args.hf_deepspeed_config, "config", None),
        getattr(args.deepspeed_plugin, "deepspeed_config", None),
    ):
        if isinstance(config, dict):
            config.pop("train_batch_size", None)


def refuse_replaced_choices(args: Any) -> None:
    """A DeepSpeed JSON's ``"optimizer"`` or ``"scheduler"`` block replaces the Trainer's own (transformers builds
    DeepSpeed's from it): an ``optim`` or ``lr_scheduler_type`` set to other than its default beside one was trained
    as the JSON's, without a word. One line, naming both."""
    given = _given_deepspeed_json(args)
    fields = type(args).__dataclass_fields__
    for block, name in (("optimizer", "optim"), ("scheduler", "lr_scheduler_type")):
        chosen = getattr(getattr(args, name), "value", getattr(args, name))
        default = getattr(fields[name].default, "value", fields[name].default)
        if isinstance(given.get(block), dict) and chosen != default:
            kind = given[block].get("type", "its")
            raise ConfigError(
                f'the DeepSpeed JSON\'s "{block}" block ({kind}) replaces TrainingArguments.{name}={chosen}, which '
                f"would not run: remove the block to train with {chosen}, or leave {name} at its default"
            )


def refuse_deepspeed_disagreements(args: Any) -> None:
    """transformers lists each DeepSpeed JSON value that disagrees with the arguments as it fills the ``"auto"``s,
    and raises the list only once training starts (a traceback on every rank): refused here, at set-up, in one
    line. ``train_batch_size`` is left to mtk's own check (TrainingArguments counts every process, mtk the
    data-parallel replicas)."""
    listed = getattr(getattr(args, "hf_deepspeed_config", None), "mismatches", None) or []
    found = [line.strip().removeprefix("- ") for line in listed]
    found = [line for line in found if not line.startswith("ds train_batch_size=")]  # (not the micro-batch's)
    listed.clear()  # (transformers would raise its global-batch one, counted over every process, when training starts)
    if found:
        raise _disagreement(found)


def _disagreement(found: list[str]) -> ConfigError:
    return ConfigError(
        f"the DeepSpeed JSON disagrees with TrainingArguments ({'; '.join(found)}): give the same values, or "
        'leave them to the arguments with "auto"'
    )


def deepspeed_processes_on_cpu(args: Any) -> None:
    """DeepSpeed on a machine without an accelerator joins the processes with gloo (as ``mtk.Accelerator`` does);
    TrainingArguments' own set-up would ask for DeepSpeed's default backend and see a single process. The state
    is built here and the arguments are told to use it (their ``use_configured_state``)."""
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    saved = os.environ.get("ACCELERATE_USE_DEEPSPEED")
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend="gloo", timeout=timedelta(seconds=args.ddp_timeout))
    finally:
        if saved is None:
            del os.environ["ACCELERATE_USE_DEEPSPEED"]
    args.accelerator_config.use_configured_state = True
    args.__dict__.pop("_setup_devices", None)
