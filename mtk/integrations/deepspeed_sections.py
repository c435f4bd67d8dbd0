"""The sections of a DeepSpeed JSON that DeepSpeed reads as objects: another type there is one line, not a
``TypeError`` from DeepSpeed's ``**block`` (or an ``AttributeError`` in accelerate's plugin) on every rank. So is a
number written as a string in the optimizer's or scheduler's ``params`` (``"lr": "1e-3"``), which DeepSpeed passes to
torch's optimizer as is."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mtk.errors import ConfigError

__all__ = ["OBJECT_SECTIONS", "check_sections"]

_PARAMS_SECTIONS = ("optimizer", "scheduler")  # their "params" go to the optimizer or scheduler class as keywords

# The top-level keys DeepSpeed (deepspeed/runtime/config.py and the config modules it calls) and mtk read as JSON
# objects, with ``**block`` or ``block.get(...)``: any other type there was a TypeError or AttributeError traceback
# on every rank. "zero_optimization" may also be DeepSpeed's legacy boolean (true: stage 1).
OBJECT_SECTIONS = (
    "zero_optimization",
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
    "bfloat16",
    "amp",
    "torch_autocast",
    "activation_checkpointing",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "comms_logger",
    "aio",
    "data_efficiency",
    "curriculum_learning",
    "compression_training",
    "checkpoint",
    "data_types",
    "pipeline",
    "hybrid_engine",
    "compile",
    "weight_quantization",
    "elasticity",
    "autotuning",
    "nebula",
    "sparse_attention",
    "eigenvalue",
    "progressive_layer_drop",
    "quantize_training",
    "timers",
    "expert_parallel",
    "mtk",
)


def check_sections(config: dict[str, Any], where: str | Path) -> None:
    """Refuse (one line) a section DeepSpeed reads as an object that the JSON gives as another type
    (``"zero_optimization": "2"``), before anything reads it: DeepSpeed's ``**block`` raised a ``TypeError`` on
    every rank."""
    for key in OBJECT_SECTIONS:
        if key not in config or isinstance(config[key], dict):
            continue
        value = config[key]
        if key == "zero_optimization" and isinstance(value, bool):
            continue
        shown = json.dumps(value) if len(json.dumps(value)) <= 40 else json.dumps(value)[:37] + "..."
        example = ', e.g. "zero_optimization": {"stage": 2},' if key == "zero_optimization" else ""
        raise ConfigError(
            f'{where}: "{key}" is {_json_type(value)} ({shown}); it must be a JSON object {{...}}: write it as '
            f"one{example} or remove it"
        )
    for key in _PARAMS_SECTIONS:
        _check_params(config.get(key), key, where)
    clipping = config.get("gradient_clipping")  # DeepSpeed takes <= 0 as none: -1 turned clipping off unsaid
    if isinstance(clipping, (int, float)) and not isinstance(clipping, bool) and not 0 <= clipping < math.inf:
        raise ConfigError(f'{where}: "gradient_clipping": {clipping} must be a finite number >= 0 (0: none)')


def _check_params(section: Any, key: str, where: str | Path) -> None:
    """``section["params"]`` an object whose numbers are numbers: a string that reads as one (``"1e-3"``) reached
    torch's optimizer as a string (a ``TypeError`` on every rank). Other strings are settings (``"warmup_type":
    "log"``, accelerate's ``"auto"``)."""
    if not isinstance(section, dict) or "params" not in section:
        return
    params = section["params"]
    if not isinstance(params, dict):
        raise ConfigError(
            f'{where}: "{key}.params" is {_json_type(params)}; it must be a JSON object of the {key}\'s arguments'
        )
    for name, value in params.items():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and _reads_as_number(item):
                raise ConfigError(
                    f'{where}: "{key}.params.{name}" holds the string "{item}"; a number must be written without '
                    f"quotes: {item}"
                )


def _reads_as_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, with its article."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "a string" if isinstance(value, str) else "an array" if isinstance(value, list) else type(value).__name__
