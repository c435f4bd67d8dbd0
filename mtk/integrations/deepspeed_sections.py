"""The top-level keys and sections of a DeepSpeed JSON, checked before DeepSpeed or accelerate reads them.

A key DeepSpeed does not read is one line naming it: DeepSpeed ignores it without a word (``"gradient_cliping"``
trained unclipped). A section DeepSpeed reads as an object given as another type is one line, not a ``TypeError``
from DeepSpeed's ``**block`` (or an ``AttributeError`` in accelerate's plugin) on every rank. So is a number written
as a string in the optimizer's or scheduler's ``params`` (``"lr": "1e-3"``), which DeepSpeed passes to torch's
optimizer as is. Keys inside ``zero_optimization``, ``fp16``, ``bf16`` and DeepSpeed's other pydantic sections need
no such check: those models forbid extra keys themselves."""

from __future__ import annotations

import ast
import difflib
import functools
import inspect
import json
import logging
import math
import textwrap
from pathlib import Path
from typing import Any

from mtk.errors import ConfigError

__all__ = [
    "OBJECT_SECTIONS",
    "check_keys",
    "check_sections",
    "deepspeed_keys",
    "idle_sections",
    "removed_deepspeed_keys",
]

_MTK_KEYS = frozenset({"mtk"})  # mtk's own block (mtk.integrations.deepspeed reads it; DeepSpeed passes it by)

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


class _ReadKeys(dict):
    """A config dict that records which of its keys are asked for, however DeepSpeed asks (``get``, ``[]``,
    ``in``, ``in d.keys()``); ``walked`` when something went through all of them, which names none."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()
        self.walked = False

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)

    def keys(self) -> Any:
        return _ReadKeysView(self)

    def __iter__(self) -> Any:
        self.walked = True
        return super().__iter__()

    def items(self) -> Any:
        self.walked = True
        return super().items()

    def values(self) -> Any:
        self.walked = True
        return super().values()

    def __copy__(self) -> _ReadKeys:
        return self


class _ReadKeysView:
    """``d.keys()`` of a :class:`_ReadKeys`: ``key in d.keys()`` is a read of ``key`` too."""

    def __init__(self, owner: _ReadKeys) -> None:
        self._owner = owner

    def __contains__(self, key: object) -> bool:
        return key in self._owner

    def __iter__(self) -> Any:
        return iter(self._owner)

    def __len__(self) -> int:
        return len(self._owner)


def _keys_named_in(function: Any, names: frozenset[str]) -> set[str]:
    """The string keys ``function``'s source looks up on a dict called one of ``names``: ``"k" in config``,
    ``config["k"]``, ``config.get("k")`` (a key of a section, ``config.get("a", {}).get("b")``, is not one)."""
    found: set[str] = set()

    def named(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id in names) or (
            isinstance(node, ast.Attribute) and node.attr in names
        )

    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(function)))):
        key: ast.expr | None = None
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            key = node.left if named(node.comparators[0]) else None
        elif isinstance(node, ast.Subscript) and named(node.value):
            key = node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            key = node.args[0] if node.args and named(node.func.value) else None
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            found.add(key.value)
    return found


@functools.cache
def deepspeed_keys() -> frozenset[str] | None:
    """Every top-level key of a training config the installed DeepSpeed reads, taken from DeepSpeed itself:
    ``DeepSpeedConfig._initialize_params`` (every ``get_*`` helper and section config it calls) run on a dict that
    records the keys asked for (once more with the legacy ``"zero_optimization": true``, whose branch reads
    ``allgather_size``); the keys ``deepspeed.initialize`` and ``DeepSpeedConfig.__init__`` look up on the raw
    dict (``sequence_parallel_size``, ``data_parallel_size``, ``tensor_parallel``); and those accelerate's
    DeepSpeed plugin reads off the user's dict (``msamp``). ``None`` when DeepSpeed cannot be read that way (not
    installed, or a version whose parsing walks every key): then no key is refused, as refusing one DeepSpeed
    reads would be worse than saying nothing."""
    try:
        import deepspeed
        from deepspeed.runtime.config import DeepSpeedConfig
        from deepspeed.utils import logger
    except ImportError:
        return None
    read: set[str] = set()
    level = logger.level
    logger.setLevel(logging.ERROR)  # the legacy probe's deprecation warning is not the user's
    try:
        for probe in ({}, {"zero_optimization": True}):
            config = _ReadKeys(probe)
            DeepSpeedConfig.__new__(DeepSpeedConfig)._initialize_params(config)
            if config.walked:
                return None
            read |= config.read
        read |= _keys_named_in(deepspeed.initialize, frozenset({"config"}))
        read |= _keys_named_in(DeepSpeedConfig.__init__, frozenset({"config"}))
    except Exception:  # noqa: BLE001 - another DeepSpeed's parsing: say nothing rather than refuse what it reads
        return None
    finally:
        logger.setLevel(level)
    try:
        from accelerate.utils import DeepSpeedPlugin

        read |= _keys_named_in(DeepSpeedPlugin, frozenset({"config", "ds_config", "deepspeed_config"}))
    except (ImportError, OSError, TypeError):
        pass  # the deepspeed launcher's path does not go through accelerate
    return frozenset(read) | _MTK_KEYS


def removed_deepspeed_keys() -> dict[str, str]:
    """The top-level keys of features the installed DeepSpeed has removed, with the message its config refuses
    each with (a ``DeepSpeedConfigError`` traceback on every rank)."""
    try:
        from deepspeed.runtime import config as ds_config
    except ImportError:
        return {}
    removed = getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {})
    return {str(key): str(message) for key, message in removed.items()} if isinstance(removed, dict) else {}


def check_keys(config: dict[str, Any], where: str | Path) -> None:
    """Refuse (one line) a top-level key DeepSpeed does not read, naming the closest one it does: DeepSpeed ignores
    it without a word, so a misspelt ``"gradient_cliping"`` trained unclipped. A key of a feature DeepSpeed has
    removed is refused with DeepSpeed's own message, in one line rather than its traceback on every rank."""
    from mtk.integrations.deepspeed import MTK_BLOCK_KEYS  # (that module imports this one)

    removed = removed_deepspeed_keys()
    known = deepspeed_keys()
    for key in config:
        if key in removed:
            raise ConfigError(f'{where}: "{key}": {removed[key].strip()}; remove it')
        if key in MTK_BLOCK_KEYS:  # mtk's sizes, written beside DeepSpeed's keys instead of in mtk's block
            raise ConfigError(
                f'{where}: "{key}" is mtk\'s, not a key DeepSpeed reads (it would be ignored without a word); '
                f'write it inside the "mtk" block: "mtk": {{"{key}": {json.dumps(config[key])}}}'
            )
        if known is None or key in known or str(key).startswith(("_", "//")):  # ("_comment": a JSON comment)
            continue
        close = difflib.get_close_matches(str(key), sorted(known), n=1)
        hint = f'did you mean "{close[0]}"?' if close else f"remove it (DeepSpeed reads: {', '.join(sorted(known))})"
        raise ConfigError(
            f'{where}: "{key}" is not a key DeepSpeed reads, so it would be ignored without a word; {hint}'
        )


def idle_sections(config: dict[str, Any], where: str | Path) -> list[str]:
    """Lines for sections DeepSpeed reads but nothing under mtk acts on: ``activation_checkpointing`` configures
    ``deepspeed.checkpointing``, which only a model that calls it uses (DeepSpeed's engine never does, nor do HF
    models); a block that asks for something (any setting on) is said, with what recomputes under mtk."""
    block = config.get("activation_checkpointing")
    if not (isinstance(block, dict) and any(block.values())):
        return []
    return [
        f'mtk: {where}: "activation_checkpointing" configures deepspeed.checkpointing, which HF models do not call, '
        "so it does nothing here; recompute with --gradient_checkpointing (run.py, finetune.py) or "
        "TrainingArguments.gradient_checkpointing"
    ]


def check_sections(config: dict[str, Any], where: str | Path) -> None:
    """Refuse (one line) a top-level key DeepSpeed does not read (:func:`check_keys`), and a section DeepSpeed
    reads as an object that the JSON gives as another type (``"zero_optimization": "2"``), before anything reads
    it: DeepSpeed's ``**block`` raised a ``TypeError`` on every rank."""
    check_keys(config, where)
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
    zero = config.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):  # DeepSpeed read "auto" as stage 0, unsaid
        raise ConfigError(
            f'{where}: "zero_optimization.stage" is {json.dumps(stage)}; write the number 0, 1, 2 or 3, without '
            "quotes (nothing fills it from the arguments)"
        )
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
