"""Typed parallelism settings, read from the places users already configure them.

``accelerate launch`` with a ``megatron_lm_config:`` block exports ``MEGATRON_LM_TP_DEGREE`` and
friends to every process (accelerate's own Megatron plugin would then require NVIDIA's Megatron-LM
package; mtk reads the variables itself instead). The pipeline schedule and per-stage layer counts,
for which accelerate's schema has no key, come from ``MTK_PIPELINE_SCHEDULE`` and ``MTK_PIPELINE_LAYERS``.
The same dataclass is built directly from Python.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from mtk.errors import ConfigError

__all__ = ["ConfigError", "ParallelConfig"]


PIPELINE_SCHEDULES = ("1f1b", "afab")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _env_int(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not an integer; set it to a positive whole number") from None


def _env_float(env: Mapping[str, str], key: str, default: float) -> float:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not a number; set it to a non-negative number") from None


def _env_int_list(env: Mapping[str, str], key: str) -> tuple[int, ...]:
    raw = env.get(key, "").strip()
    if not raw:
        return ()
    try:
        return tuple(int(part) for part in raw.split(","))
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not a comma-separated list of integers, e.g. 3,1") from None


def _env_bool(env: Mapping[str, str], key: str, default: bool) -> bool:
    raw = env.get(key)
    if raw is None:
        return default
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise ConfigError(f"{key}={raw!r} is not a boolean; use true or false")


@dataclass(frozen=True)
class ParallelConfig:
    """How one model replica is split and how a batch flows through it.

    Attributes:
        tp_size: tensor-parallel degree; each layer's weights are split over this many ranks.
        pp_size: pipeline-parallel degree; the stack of layers is cut into this many stages.
        num_micro_batches: micro-batches per step for the pipeline schedule (1 without PP).
        sequence_parallel: split norm/dropout activations along the sequence inside TP groups.
        gradient_clipping: max global grad norm; 0 disables clipping.
        pipeline_schedule: ``1f1b`` (PipeDream-flush: at most ``pp`` micro-batches of activations held)
            or ``afab`` (all forwards, then all backwards: ``num_micro_batches`` held).
        pipeline_layers: decoder layers per stage, e.g. ``(3, 1)``; empty: as even as possible.
    """

    tp_size: int = 1
    pp_size: int = 1
    num_micro_batches: int = 1
    sequence_parallel: bool = False
    gradient_clipping: float = 0.0
    pipeline_schedule: str = "1f1b"
    pipeline_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "num_micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.gradient_clipping < 0:
            raise ConfigError(f"gradient_clipping must be >= 0 (0 disables it), got {self.gradient_clipping}")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ConfigError(
                f"pipeline schedule {self.pipeline_schedule!r} is unknown; use one of {PIPELINE_SCHEDULES}"
            )
        if self.pipeline_layers:
            if len(self.pipeline_layers) != self.pp_size or min(self.pipeline_layers) < 1:
                raise ConfigError(
                    f"pipeline_layers {list(self.pipeline_layers)} must give each of the {self.pp_size} stages "
                    f"at least one layer (e.g. MTK_PIPELINE_LAYERS=3,1 for pp=2)"
                )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ParallelConfig:
        """Read the ``MEGATRON_LM_*`` variables ``accelerate launch`` exports; absent ones default."""
        env = os.environ if env is None else env
        return cls(
            tp_size=_env_int(env, "MEGATRON_LM_TP_DEGREE", 1),
            pp_size=_env_int(env, "MEGATRON_LM_PP_DEGREE", 1),
            num_micro_batches=_env_int(env, "MEGATRON_LM_NUM_MICRO_BATCHES", 1),
            sequence_parallel=_env_bool(env, "MEGATRON_LM_SEQUENCE_PARALLELISM", False),
            gradient_clipping=_env_float(env, "MEGATRON_LM_GRADIENT_CLIPPING", 0.0),
            pipeline_schedule=env.get("MTK_PIPELINE_SCHEDULE", "1f1b").strip().lower(),
            pipeline_layers=_env_int_list(env, "MTK_PIPELINE_LAYERS"),
        )
