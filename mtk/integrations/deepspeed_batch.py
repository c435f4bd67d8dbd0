"""DeepSpeed's three batch fields, reconciled with the script's flags under mtk's topology.

DeepSpeed's rule is ``train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x DP``,
where DP is what the ``mpu`` reports: world / (tp x pp), not the number of processes. Given two of the
three it derives the third; given only one of the batch sizes it accumulates once; given all three they
must agree. mtk applies the same rule before DeepSpeed (or accelerate) sees the JSON, with the script's
flags in the picture, so the engine, the data loader and the loss weighting use one set of numbers:

- a flag (``--batch_size``, ``--grad_accum``; under accelerate the DataLoader's ``batch_size`` and
  ``Accelerator(gradient_accumulation_steps=...)``) replaces the JSON's value of its own field, and a JSON
  value it changes is reported in one line;
- ``"auto"`` is a value not given (under accelerate and under the DeepSpeed launcher alike);
- then DeepSpeed's rule: all three given must agree (when a flag made them disagree ``train_batch_size``
  follows the flags, reported; when the JSON's own values disagree, refused); two given derive the third,
  which must come out whole (refused otherwise, naming the allowed values); only ``train_batch_size``
  or only the micro-batch -> accumulation 1; no batch size at all -> refused.

Every refusal is one line saying what is wrong and what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mtk.config import ConfigError

__all__ = ["BATCH_FIELDS", "BatchSizes", "dp_layout", "reconcile_batch"]

TRAIN_BATCH, MICRO, ACCUMULATION = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
BATCH_FIELDS = (TRAIN_BATCH, MICRO, ACCUMULATION)


@dataclass(frozen=True)
class BatchSizes:
    """One optimizer step's batch: ``micro_batch_size`` rows per DP replica per micro-batch, ``accumulation``
    micro-batches, ``dp_size`` replicas."""

    micro_batch_size: int
    accumulation: int
    dp_size: int

    @property
    def global_batch(self) -> int:
        """Rows (examples, or packed rows) per optimizer step: DeepSpeed's ``train_batch_size``."""
        return self.micro_batch_size * self.accumulation * self.dp_size

    def apply(self, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` with the three fields set to these values (in place; returns it)."""
        config[TRAIN_BATCH] = self.global_batch
        config[MICRO] = self.micro_batch_size
        config[ACCUMULATION] = self.accumulation
        return config

    def describe(self) -> str:
        sizes = f"micro {self.micro_batch_size} x accumulation {self.accumulation} x dp {self.dp_size}"
        return f"global batch {self.global_batch} = {sizes}"


def dp_layout(world_size: int, tp_size: int, pp_size: int = 1, cp_size: int = 1) -> str:
    """How DP came about, for messages: ``" (dp = world 4 / tp 2)"``."""
    parts = [f"{name} {size}" for name, size in (("tp", tp_size), ("cp", cp_size), ("pp", pp_size)) if size > 1]
    parts = parts or [f"tp {tp_size}"]
    model = parts[0] if len(parts) == 1 else f"({' x '.join(parts)})"
    return f" (dp = world {world_size} / {model})"


def _says(flag: str, value: int | str) -> str:
    """``--grad_accum 2``, or ``flag`` with the value in its ``{}``: ``Accelerator(gradient_accumulation_steps=2)``."""
    return flag.format(value) if "{}" in flag else f"{flag} {value}"


def _json_value(config: Mapping[str, Any], key: str, where: str) -> int | None:
    value = config.get(key)
    if value is None or value == "auto":
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f'{where}: "{key}": {value!r} must be a positive integer or "auto"')
    return value


def _whole(total: int, divisor: int, total_says: str, divisor_says: str, where: str) -> int:
    """``total / divisor``, or one line naming the totals that would divide."""
    if total % divisor:
        allowed = ", ".join(str(divisor * k) for k in range(1, 4))
        raise ConfigError(
            f"{where}: {total_says} is not a multiple of {divisor_says} = {divisor}; allowed: {allowed}, ... "
            f"(DeepSpeed's train_batch_size = micro-batch x accumulation x dp)"
        )
    return total // divisor


def reconcile_batch(
    config: Mapping[str, Any],
    dp_size: int,
    *,
    micro_batch_size: int | None = None,
    accumulation: int | None = None,
    micro_flag: str = "--batch_size",
    accumulation_flag: str = "--grad_accum",
    where: str = "the DeepSpeed JSON",
    layout: str = "",
) -> tuple[BatchSizes, str | None]:
    """The batch this run uses, and the one line reporting what the flags override (``None`` if nothing).

    Args:
        config: the DeepSpeed JSON (read only); its batch fields may be integers, ``"auto"`` or absent.
        dp_size: data-parallel replicas (world / (tp x pp)).
        micro_batch_size, accumulation: the script's explicit values (``None``: not given).
        micro_flag, accumulation_flag, where: how messages name the flags (the value follows, or fills a ``{}``)
            and the JSON.
        layout: how DP came about, for messages (e.g. ``" (dp = world 4 / tp 2)"``).

    Raises:
        ConfigError: one line, when the values cannot be honoured (see the module docstring).
    """
    stated = {key: _json_value(config, key, where) for key in BATCH_FIELDS}
    own = BatchSizes(stated[MICRO] or 0, stated[ACCUMULATION] or 0, dp_size)
    if stated[TRAIN_BATCH] is not None and own.global_batch and own.global_batch != stated[TRAIN_BATCH]:
        raise ConfigError(
            f"{where}: {TRAIN_BATCH} {stated[TRAIN_BATCH]} != {MICRO} {own.micro_batch_size} x {ACCUMULATION} "
            f"{own.accumulation} x dp {dp_size} = {own.global_batch}{layout}; give two of the three (the third is "
            "derived), or values that agree"
        )
    overrides, flags = [], []
    for key, flag, value in ((MICRO, micro_flag, micro_batch_size), (ACCUMULATION, accumulation_flag, accumulation)):
        if value is None:
            continue
        flags.append(_says(flag, value))
        if stated[key] is not None and stated[key] != value:
            overrides.append(f"{flags[-1]} overrides {key} {stated[key]}")
        stated[key] = value
    train_batch, mb, ga = stated[TRAIN_BATCH], stated[MICRO], stated[ACCUMULATION]
    mb_says = _says(micro_flag, mb) if micro_batch_size is not None and mb is not None else f"{MICRO} {mb}"
    ga_says = _says(accumulation_flag, ga) if accumulation is not None and ga is not None else f"{ACCUMULATION} {ga}"
    if train_batch is None:
        if mb is None:
            raise ConfigError(
                f"{where} gives no batch size ({MICRO} and {TRAIN_BATCH} absent or 'auto'): set one of them to an "
                f"integer, or pass {_says(micro_flag, 'N')}"
            )
        batch = BatchSizes(mb, ga or 1, dp_size)
    elif mb is not None and ga is not None:
        batch = BatchSizes(mb, ga, dp_size)
        if batch.global_batch != train_batch:  # the JSON agrees with itself: a flag changed it
            overrides.append(f"{TRAIN_BATCH} {train_batch} -> {batch.global_batch} (follows {' and '.join(flags)})")
    elif mb is not None:
        tb_says = f"{TRAIN_BATCH} {train_batch}"
        mb_dp = f"{mb_says} x dp {dp_size}{layout}"
        batch = BatchSizes(mb, _whole(train_batch, mb * dp_size, tb_says, mb_dp, where), dp_size)
    else:
        ga = ga or 1
        divisor_says = f"{ga_says} x dp {dp_size}" if stated[ACCUMULATION] is not None else f"dp {dp_size}"
        divisor_says += layout
        batch = BatchSizes(
            _whole(train_batch, ga * dp_size, f"{TRAIN_BATCH} {train_batch}", divisor_says, where), ga, dp_size
        )
    note = f"mtk: {'; '.join(overrides)} in {where}: {batch.describe()}{layout}" if overrides else None
    return batch, note
