"""Which ``TrainingArguments`` (and TRL config) fields mtk's trainers act on, and one line for each it refuses.

transformers' ``Trainer`` reads 114 fields. Most keep their meaning under mtk because mtk implements the API they
go through (the optimizer and scheduler, clipping, logging, evaluation, data loading over the data-parallel
replicas). The ones below would, under tensor or pipeline parallelism, build a second parallel layout, bypass
mtk's vocab-parallel head or its recompute, or save something mtk cannot restore exactly; each is refused in one
line naming what to use instead, rather than accepted and silently wrong.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import typing
from dataclasses import replace
from pathlib import Path
from typing import Any

from mtk import jsonio
from mtk.config import RunSettings
from mtk.errors import ConfigError

__all__ = [
    "check_training_arguments",
    "check_deepspeed_file",
    "clipping_report",
    "epochs_over_a_default_step_count",
    "jit_checkpoint_report",
    "recompute_settings",
    "refuse_null_settings",
]


def _refusals(args: Any) -> list[str]:
    problems = []
    if getattr(args, "fsdp", None):
        problems.append(
            f"TrainingArguments.fsdp={args.fsdp!r}: mtk shards its TP model with FSDP2 over data parallelism from "
            "accelerate's parallelism_config (TrainingArguments.parallelism_config=ParallelismConfig(tp_size=..., "
            "dp_shard_size=...), or accelerate_configs/tp2_fsdp2.yaml); remove fsdp"
        )
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1  # (args.world_size would set up the devices now)
    if str(getattr(args, "train_sampling_strategy", "random")) == "batch_rebalance" and launched:
        problems.append(
            "TrainingArguments.train_sampling_strategy=batch_rebalance is not supported by mtk's Trainer in a "
            "launched run yet: its sampler assigns each step's rows per process, which mtk's loaders do not follow "
            "(at TP 2 it trained half of them); use random (the default) or group_by_length"
        )
    if getattr(args, "torch_compile", False):
        problems.append(
            "TrainingArguments.torch_compile=True: mtk's parallel layers are not compiled yet; leave it off"
        )
    if getattr(args, "use_liger_kernel", False):
        problems.append(
            "TrainingArguments.use_liger_kernel=True: Liger's kernels replace the layers mtk makes parallel; "
            "leave it off"
        )
    if getattr(args, "neftune_noise_alpha", None) is not None:
        problems.append(
            "TrainingArguments.neftune_noise_alpha: NEFTune's embedding noise is not made tensor-parallel by mtk "
            "yet; leave it unset"
        )
    if getattr(args, "save_only_model", False):
        problems.append(
            "TrainingArguments.save_only_model=True: mtk's checkpoints always hold what resumes exactly (weights, "
            "optimizer, scheduler, RNG); leave it off, and use trainer.save_model() for weights alone"
        )
    if getattr(args, "save_on_each_node", False):
        problems.append(
            "TrainingArguments.save_on_each_node=True: each rank writes its own shard of one checkpoint; leave it off"
        )
    if getattr(args, "n_gpu", 1) > 1:
        problems.append(
            "several GPUs visible to one process (torch.nn.DataParallel): launch one process per GPU with "
            "accelerate launch"
        )
    return problems


def _bad_values(args: Any) -> list[str]:
    """Values transformers and TRL take and then fail on deep inside (a division by zero, a NaN step): one line
    each, naming the field."""
    problems = []
    for field_name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        value = getattr(args, field_name, 1)
        if not isinstance(value, int) or value < 1:
            problems.append(f"TrainingArguments.{field_name}={value!r}: must be a positive integer")
    problems += _non_finite(args)
    rate = getattr(args, "learning_rate", 0.0)
    if not isinstance(rate, (int, float)) or rate < 0:  # (NaN and inf: above)
        problems.append(f"TrainingArguments.learning_rate={rate!r}: must be a finite number >= 0")
    length = getattr(args, "max_length", None)  # TRL's configs: tokens per row, of which one predicts the next
    if length is not None and (not isinstance(length, int) or length < 2):
        problems.append(f"{type(args).__name__}.max_length={length!r}: must be at least 2 tokens (or None)")
    problems += _output_dir_under_a_file(args)
    return problems


def _non_finite(args: Any) -> list[str]:
    """Every float field (or list of floats) that is NaN or infinite. None of them means anything then, and each
    trains silently wrong rather than failing: a NaN ``weight_decay`` or DPO ``beta`` saves an all-NaN model, a
    NaN ``max_grad_norm`` turns clipping off. Fields are named by the class that declares them
    (``TrainingArguments.weight_decay``, ``DPOConfig.beta``)."""
    if not dataclasses.is_dataclass(args):
        return []
    from transformers import TrainingArguments

    theirs = {field.name for field in dataclasses.fields(TrainingArguments)}
    problems = []
    for field in dataclasses.fields(args):
        value = getattr(args, field.name, None)
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            owner = "TrainingArguments" if field.name in theirs else type(args).__name__
            problems.append(f"{owner}.{field.name}={value!r}: must be a finite number")
    return problems


def _output_dir_under_a_file(args: Any) -> list[str]:
    """An ``output_dir`` that is an existing file, or lies under one: refused before anything is written (the
    Trainer's ``makedirs`` would fail with ``FileExistsError``, or once it first saves)."""
    given = getattr(args, "output_dir", None)
    if not given:
        return []
    path = Path(given)
    while not path.exists() and path != path.parent:
        path = path.parent
    if not path.exists() or path.is_dir():
        return []
    where = "is" if path == Path(given) else f"is under {path}, which is"
    return [
        f"TrainingArguments.output_dir={given!r} {where} an existing file: checkpoints and the model are saved into "
        "a folder; choose another output_dir (or move the file)"
    ]


def check_training_arguments(args: Any) -> None:
    """Raise :class:`ConfigError` naming the first field mtk cannot honour or value that cannot run (one line)."""
    problems = _bad_values(args) + _refusals(args)
    if problems:
        raise ConfigError(problems[0])


def clipping_report(args: Any, settings: RunSettings) -> str | None:
    """The line saying which clipping wins when the launcher's ``megatron_lm_gradient_clipping`` and
    ``TrainingArguments.max_grad_norm`` disagree (the Trainer clips; mtk's scripts read the launcher's)."""
    launcher = settings.gradient_clipping
    if not launcher or launcher == args.max_grad_norm:
        return None
    return (
        f"mtk: the Trainer clips at TrainingArguments.max_grad_norm={args.max_grad_norm}; the accelerate config's "
        f"megatron_lm_gradient_clipping={launcher} is not used"
    )


def recompute_settings(args: Any, settings: RunSettings) -> tuple[RunSettings, str | None]:
    """``gradient_checkpointing`` (TRL's SFT default) as mtk's recompute, and the line saying so.

    transformers' checkpointing reruns each block's forward with only torch's global RNG restored; mtk's recompute
    also restores the tensor-parallel dropout stream, so it is the one that runs. The arguments' own flag is then
    turned off (the Trainer would otherwise wrap the blocks a second time). Recompute already set in the
    accelerate config wins and is reported.
    """
    wanted = getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing", False)
    if not wanted:
        return settings, None
    args.gradient_checkpointing = False
    if hasattr(args, "activation_checkpointing"):
        args.activation_checkpointing = False
    unused = _unused_checkpointing_kwargs(args)
    if settings.recompute_activations or settings.recompute_granularity is not None:
        return settings, (
            "mtk: TrainingArguments.gradient_checkpointing is replaced by the accelerate config's recompute "
            f"(megatron_lm_recompute_granularity={settings.recompute_granularity or 'selective'}){unused}"
        )
    settings = replace(settings, recompute_activations=True, recompute_granularity="full", recompute_method="uniform")
    return settings, (
        "mtk: TrainingArguments.gradient_checkpointing runs as mtk's full recompute of every block (which also "
        f"restores the tensor-parallel dropout stream); transformers' checkpointing is not used{unused}"
    )


def jit_checkpoint_report(args: Any) -> str | None:
    """``enable_jit_checkpoint`` (a checkpoint when SIGTERM arrives) is what mtk's trainers do on every signal
    already, each rank saving its shards at the end of the step it is in; transformers' own handler, which one
    process would run at a moment of its choosing, is not installed. The line saying so."""
    if not getattr(args, "enable_jit_checkpoint", False):
        return None
    args.enable_jit_checkpoint = False
    return (
        "mtk: TrainingArguments.enable_jit_checkpoint: mtk's trainers save checkpoint-N on SIGTERM (and SIGINT, "
        "SIGHUP) at the end of the step every rank is in; transformers' just-in-time handler is not installed"
    )


def _unused_checkpointing_kwargs(args: Any) -> str:
    """The part of the recompute line naming the checkpointing keyword arguments mtk's recompute does not take
    (TRL's ``selective``, ``every_n_layers``, ``offload``, a reentrant checkpoint); mtk's is non-reentrant."""
    unused: list[str] = []
    seen: list[Any] = []
    for field_name in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
        given = getattr(args, field_name, None) or {}
        if any(given == other for other in seen):  # (transformers 5 keeps one dict under both names)
            continue
        seen.append(given)
        keys = sorted(key for key, value in given.items() if (key, value) != ("use_reentrant", False))
        if keys:
            unused.append(f"{field_name} {', '.join(keys)}")
    return f"; {' and '.join(unused)} not used" if unused else ""


def _config_file_values(argv: list[str]) -> dict[str, Any]:
    """The mapping of the YAML ``--config`` a TrlParser command line names (empty without one)."""
    if "--config" not in argv:
        return {}
    if argv.index("--config") + 1 >= len(argv):
        raise ConfigError("--config needs the path of a YAML file after it")
    import yaml

    path = argv[argv.index("--config") + 1]
    with open(path) as file:  # (a file that is missing: one line, as library_refusals words it)
        try:
            values = yaml.safe_load(file)
        except yaml.YAMLError as err:
            where = getattr(err, "problem_mark", None)
            at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
            problem = getattr(err, "problem", None) or err
            raise ConfigError(f"--config {path} is not valid YAML{at}: {problem}") from err
    return values if isinstance(values, dict) else {}  # (TrlParser says what is wrong with another value)


def refuse_null_settings(parser: Any, argv: list[str] | None = None) -> None:
    """A ``--config`` YAML key set to ``null`` whose field's type takes no None (``max_steps: null``) and that no
    flag overrides: the arguments' own checks compared None with a number, a ``TypeError`` traceback. One line
    naming the keys; a null where None means something (SFTConfig's ``max_length``: no truncation) stays."""
    argv = list(sys.argv[1:] if argv is None else argv)
    nulls = {name for name, value in _config_file_values(argv).items() if value is None}
    if not nulls:
        return
    without_none = {
        field.name
        for kind in parser.dataclass_types
        for field in dataclasses.fields(kind)
        if field.init and type(None) not in typing.get_args(typing.get_type_hints(kind).get(field.name))
    }
    refused = sorted(name for name in nulls & without_none if not _on_the_command_line(parser, argv, name))
    if refused:
        raise ConfigError(
            f"--config sets {', '.join(refused)} to null, which takes a value: give one, or leave the key out for "
            "the default"
        )


def check_deepspeed_file(argv: list[str] | None = None) -> None:
    """The DeepSpeed JSON a TrlParser command line names (``--deepspeed FILE``, or its YAML ``--config``'s
    ``deepspeed``) and the one ``accelerate launch``'s YAML names, read before transformers reads them while the
    arguments are made: a file that is not JSON was its parser's words alone ("Expecting value: line 1 column 22",
    "'utf-8' codec can't decode byte 0xff"), naming no file. One line naming it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    given: Any = _config_file_values(argv).get("deepspeed")
    for at, word in enumerate(argv):
        if word == "--deepspeed" and at + 1 < len(argv):
            given = argv[at + 1]
        elif word.startswith("--deepspeed="):
            given = word.split("=", 1)[1]
    named = [("--deepspeed", given)]
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true", "yes"):  # (TrainingArguments builds
        # accelerate's plugin from the file the launcher's YAML names while the arguments are made)
        launcher = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        named.append(("the accelerate YAML's deepspeed_config_file", launcher))
    for what, path in named:
        if not isinstance(path, str) or not Path(path).is_file():
            continue  # (a dict, or a path transformers refuses in its own words)
        try:
            jsonio.read(path)
        except (OSError, ValueError) as err:
            if "given twice" in str(err):  # (transformers would keep the last)
                raise ConfigError(f"DeepSpeed config {path}: {err}; give each key once") from None
            raise ConfigError(f"{what} {path} is not valid JSON ({err}); fix the file") from None


def _on_the_command_line(parser: Any, argv: list[str], name: str) -> bool:
    """Whether ``argv`` (without its ``--config``) sets ``name``, in any spelling the parser takes: argparse leaves a
    value the namespace holds unless the command line sets it."""
    argv = list(argv)
    if "--config" in argv:
        at = argv.index("--config")
        del argv[at : at + 2]
    unset = object()
    found, _ = parser.parse_known_args(argv, argparse.Namespace(**{name: unset}))
    return getattr(found, name) is not unset


def epochs_over_a_default_step_count(parser: Any, config: Any, argv: list[str] | None = None) -> None:
    """An example script's default ``max_steps`` (a short first run) yields to ``num_train_epochs`` the user gives
    without ``max_steps``: transformers lets a positive ``max_steps`` win, so ``--num_train_epochs 10`` trained the
    default 40 steps, without a word. "Given" is the parser's own reading (``--num-train-epochs``, an abbreviation)
    of the command line, or a key of the YAML ``--config`` TrlParser read."""
    argv = list(sys.argv[1:] if argv is None else argv)
    in_yaml = set(_config_file_values(argv))

    def given(name: str) -> bool:
        return name in in_yaml or _on_the_command_line(parser, argv, name)

    if given("num_train_epochs") and not given("max_steps"):
        config.max_steps = -1
