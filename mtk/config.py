"""Typed settings, read once: where the TP size (and every other setting) comes from.

Two records, kept apart because they change for different reasons:

- :class:`ParallelConfig` is the topology: how many ranks split one model replica (``tp_size``,
  ``pp_size``). The process groups are built from it (:class:`~mtk.parallel.state.ParallelState`).
- :class:`RunSettings` is how a step runs on that topology: micro-batches, pipeline schedule and
  layer split, sequence parallelism, activation recomputation, gradient clipping.

Each is read by ``from_env(env, **explicit)``. Precedence, highest first:

1. an explicit value: an Accelerator argument (``parallel_config=``, ``run_settings=``) or a script
   flag (``--tp``, ``--pipeline_schedule``, ...), passed as ``explicit``;
2. the launcher's environment: ``accelerate launch`` exports the ``megatron_lm_config`` block of the
   YAML as ``MEGATRON_LM_*``; ``MTK_PIPELINE_SCHEDULE`` / ``MTK_VIRTUAL_STAGES`` / ``MTK_PIPELINE_LAYERS`` fill the
   settings accelerate's schema has no key for;
3. the defaults below.

An explicit value that overrides a different environment value is reported in one line (``mtk:
tp_size=2 (explicit) overrides MEGATRON_LM_TP_DEGREE=4``), never silently dropped. With DeepSpeed
through accelerate the TP size may also come from the DeepSpeed JSON (``"mtk": {"tensor_parallel_size":
N}``), which ranks with the environment (:func:`mtk.integrations.deepspeed.sizes_from_config`).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mtk.errors import ConfigError

__all__ = [
    "CP_COMM_TYPES",
    "PIPELINE_SCHEDULES",
    "ConfigError",
    "ParallelConfig",
    "RunSettings",
    "check_schedule",
    "parse_bool",
    "report_override",
]

PIPELINE_SCHEDULES = ("1f1b", "afab", "interleaved")


def check_schedule(name: str, num_stages: int, num_micro_batches: int, virtual_stages: int) -> str | None:
    """What is wrong with running ``name`` at this layout (one line), or ``None``."""
    if name not in PIPELINE_SCHEDULES:
        return f"pipeline schedule {name!r} is unknown; use one of {', '.join(PIPELINE_SCHEDULES)}"
    if name != "interleaved":
        if virtual_stages != 1:
            return f"virtual_stages = {virtual_stages} needs the interleaved schedule (pipeline_schedule interleaved)"
        return None
    if virtual_stages < 2:
        return "the interleaved schedule needs virtual_stages >= 2 (model chunks per pipeline rank), e.g. 2"
    if num_micro_batches % num_stages:
        return (
            f"the interleaved schedule sends micro-batches through the chunks in groups of pp = {num_stages}: "
            f"{num_micro_batches} micro-batches is not a multiple; use a multiple of {num_stages}"
        )
    return None


logger = logging.getLogger("mtk")

RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
CP_COMM_TYPES = ("p2p", "a2a")  # Megatron's cp_comm_type values mtk runs
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_int(key: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not an integer; set it to a positive whole number") from None


def _parse_optional_int(key: str, raw: str) -> int | None:
    """An integer, or ``None`` for accelerate's ``None`` (the key left at its default)."""
    return None if raw.strip().lower() == "none" else _parse_int(key, raw)


def _parse_float(key: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):  # NaN or inf would pass every comparison's check, or none
        raise ConfigError(f"{key}={raw!r} is not a finite number; set it to a non-negative number")
    return value


def parse_bool(key: str, raw: str) -> bool:
    """A launcher variable's boolean (true/false, 1/0, ...); anything else is one line naming it."""
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise ConfigError(f"{key}={raw!r} is not a boolean; use true or false")


def _parse_int_list(key: str, raw: str) -> tuple[int, ...]:
    if not raw.strip():
        return ()
    try:
        return tuple(int(part) for part in raw.split(","))
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not a comma-separated list of integers, e.g. 3,1") from None


def _parse_word(key: str, raw: str) -> str:
    return raw.strip().lower()


def report_override(field: str, value: Any, source: str, source_value: Any) -> None:
    """Say, in one line, that an explicit ``value`` replaced what ``source`` set."""
    logger.warning("mtk: %s=%s (explicit) overrides %s=%s", field, value, source, source_value)


def _resolve(
    values: dict[str, Any],
    env: Mapping[str, str],
    sources: Mapping[str, tuple[str, Callable[[str, str], Any]]],
    explicit: dict[str, Any],
) -> dict[str, Any]:
    """``{field: value}`` from explicit values, then the environment; overrides are reported."""
    unknown = sorted(set(explicit) - set(sources))
    if unknown:
        raise ConfigError(f"unknown settings {unknown}; known: {sorted(sources)}")
    for field, (key, parse) in sources.items():
        raw = env.get(key)
        from_env = parse(key, raw) if raw not in (None, "") else None
        given = explicit.get(field)
        if given is not None:
            if from_env is not None and from_env != given:
                report_override(field, given, key, raw)
            values[field] = given
        elif from_env is not None:
            values[field] = from_env
    return values


@dataclass(frozen=True)
class ParallelConfig:
    """The topology: how one model replica is split (data parallelism takes the remaining ranks).

    Attributes:
        tp_size: tensor-parallel degree; each layer's weights are split over this many ranks
            (``MEGATRON_LM_TP_DEGREE``).
        pp_size: pipeline-parallel degree; the stack of layers is cut into this many stages
            (``MEGATRON_LM_PP_DEGREE``).
        cp_size: context-parallel degree; each sequence is split over this many ranks, which hold the same
            weights (``MEGATRON_LM_CONTEXT_PARALLEL_SIZE``, accelerate's ``megatron_lm_context_parallel_size``).
        ep_size: expert-parallel degree; each MoE layer's experts are spread over this many of the ranks that hold
            the same dense weights (``MEGATRON_LM_EXPERT_MODEL_PARALLEL_SIZE``, accelerate's
            ``megatron_lm_expert_model_parallel_size``); it divides DP x CP.
        etp_size: the experts' tensor-parallel size (Megatron's expert-tensor parallelism,
            ``MEGATRON_LM_EXPERT_TENSOR_PARALLEL_SIZE``): ``None`` or ``tp_size`` splits each expert over the TP
            group as the dense MLPs are split; ``1`` keeps every expert whole on every TP rank, each TP rank running
            them on its share of the tokens (:mod:`mtk.parallel.expert_tokens`).
    """

    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    etp_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "cp_size", "ep_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        check_expert_tp_size(self.etp_size, self.tp_size)

    @property
    def expert_tp_size(self) -> int:
        """The experts' TP size in effect: ``etp_size``, or the TP size when it is not given."""
        return self.tp_size if self.etp_size is None else self.etp_size

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **explicit: Any) -> ParallelConfig:
        """Explicit ``tp_size``/``pp_size``/``cp_size``/``ep_size`` (``None`` = not given), else the
        ``MEGATRON_LM_*`` variables."""
        sources = {
            "tp_size": ("MEGATRON_LM_TP_DEGREE", _parse_int),
            "pp_size": ("MEGATRON_LM_PP_DEGREE", _parse_int),
            "cp_size": ("MEGATRON_LM_CONTEXT_PARALLEL_SIZE", _parse_int),
            "ep_size": ("MEGATRON_LM_EXPERT_MODEL_PARALLEL_SIZE", _parse_int),
            "etp_size": ("MEGATRON_LM_EXPERT_TENSOR_PARALLEL_SIZE", _parse_optional_int),
        }
        return cls(**_resolve({}, os.environ if env is None else env, sources, explicit))


def check_expert_tp_size(etp_size: Any, tp_size: int) -> None:
    """The experts' TP size is the TP size or 1 (one line otherwise): mtk splits each expert over the whole TP
    group or keeps it whole; a size between (Megatron allows any divisor) is not built."""
    if etp_size is None or (type(etp_size) is int and etp_size in (1, tp_size)):
        return
    allowed = f"set it to {tp_size} or 1" if tp_size > 1 else "at tp 1 it can only be 1: set it to 1, or unset it"
    raise ConfigError(
        f"expert tensor parallel size (megatron_lm_expert_tensor_parallel_size) {etp_size!r}: mtk splits each expert "
        f"over the TP size ({tp_size}) or keeps every expert whole on each TP rank (1); {allowed}"
    )


@dataclass(frozen=True)
class RunSettings:
    """How a training step runs on the topology.

    Attributes:
        num_micro_batches: micro-batches per step for the pipeline schedule (``MEGATRON_LM_NUM_MICRO_BATCHES``).
        pipeline_schedule: ``1f1b`` (PipeDream-flush: at most ``pp`` micro-batches of activations held),
            ``afab`` (all forwards, then all backwards) or ``interleaved`` (Megatron's virtual pipeline:
            ``virtual_stages`` model chunks per rank, a ``1/v`` bubble) (``MTK_PIPELINE_SCHEDULE``).
        virtual_stages: model chunks per pipeline rank for ``interleaved`` (``MTK_VIRTUAL_STAGES``).
        pipeline_layers: decoder layers per stage (per model chunk with virtual stages), e.g. ``(3, 1)``;
            empty: even with the LM head counted as layers of the last stage (:mod:`mtk.pipeline.balance`)
            (``MTK_PIPELINE_LAYERS``; checked against the model when it is cut).
        sequence_parallel: split norm/dropout activations along the sequence inside TP groups
            (``MEGATRON_LM_SEQUENCE_PARALLELISM``).
        gradient_clipping: max global grad norm; 0 disables clipping (``MEGATRON_LM_GRADIENT_CLIPPING``).
        eod_mask_loss: no loss on the token after an end of document (``MEGATRON_LM_EOD_MASK_LOSS``, which
            ``accelerate launch`` always exports, ``False`` unless set). mtk's data always masks it (a
            packed row gives each example's first token label -100, so packed equals unpacked; a padded
            row holds one example); the scripts report the override when packing meets ``False``.
        last_stage_layers: decoder layers on the last pipeline stage, the rest split evenly over the
            others (``MEGATRON_LM_DECODER_LAST_PIPELINE_NUM_LAYERS``); must agree with ``pipeline_layers``.
        recompute_activations: recompute activations in backward instead of keeping them; alone it means
            ``selective`` (``MEGATRON_LM_RECOMPUTE_ACTIVATIONS``, as accelerate documents it).
        recompute_granularity: ``full`` (each chosen block keeps only its input and reruns its forward
            in backward) or ``selective`` (every block keeps its matmul outputs and reruns the cheap
            rest: norms, activations, softmax, dropout) (``MEGATRON_LM_RECOMPUTE_GRANULARITY``); setting it
            turns recompute on.
        recompute_method: for ``full``: ``uniform`` (every block) or ``block`` (the first
            ``recompute_num_layers`` blocks of each stage) (``MEGATRON_LM_RECOMPUTE_METHOD``).
        recompute_num_layers: for ``block``, blocks recomputed per stage; for ``uniform``, Megatron's
            group size (mtk checkpoints HF's blocks one at a time) (``MEGATRON_LM_RECOMPUTE_NUM_LAYERS``).
        use_distributed_optimizer: shard the optimizer state over the DP group, ZeRO-1 style, without
            DeepSpeed (:mod:`mtk.parallel.distributed_optimizer`) (``MEGATRON_LM_USE_DISTRIBUTED_OPTIMIZER``).
        loss_chunk_tokens: the training loss takes the LM head's product over in chunks of this many tokens and
            never holds the ``[b, s, V/tp]`` logits (:mod:`mtk.parallel.chunked_loss`); unset: chunks of at most
            256 MiB of fp32 logits; 0: off (``MTK_LOSS_CHUNK_TOKENS``).
        cp_comm_type: how context-parallel attention exchanges the sequence, Megatron's name: ``p2p`` (ring
            attention, keys and values passed around the CP group) or ``a2a`` (all-to-all between sequence and
            heads, Ulysses) (``MTK_CP_COMM_TYPE``; accelerate's schema has no key for it).
    """

    num_micro_batches: int = 1
    pipeline_schedule: str = "1f1b"
    pipeline_layers: tuple[int, ...] = ()
    virtual_stages: int = 1
    sequence_parallel: bool = False
    gradient_clipping: float = 0.0
    eod_mask_loss: bool | None = None
    last_stage_layers: int | None = None
    recompute_activations: bool = False
    recompute_granularity: str | None = None
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    use_distributed_optimizer: bool = False
    loss_chunk_tokens: int | None = None
    cp_comm_type: str = "p2p"

    def check_pipeline(self, pp_size: int) -> list[str]:
        """Refuse (one line) a schedule this layout cannot run; returns lines to report for pipeline
        settings that do nothing at ``pp_size = 1``."""
        if pp_size == 1:
            unused = {
                "pipeline_schedule": self.pipeline_schedule if self.pipeline_schedule != "1f1b" else None,
                "virtual_stages": self.virtual_stages if self.virtual_stages != 1 else None,
                "pipeline_layers": ",".join(map(str, self.pipeline_layers)) or None,
                "decoder_last_pipeline_num_layers": self.last_stage_layers,
                "num_micro_batches": self.num_micro_batches if self.num_micro_batches != 1 else None,
            }
            lines = [
                f"mtk: {key}={value} does nothing at pp = 1" for key, value in unused.items() if value is not None
            ]
            if unused["num_micro_batches"] is not None:  # Megatron accumulates its micro-batches at pp = 1; mtk's is
                lines[-1] += " (gradient accumulation is gradient_accumulation_steps, or --grad_accum)"
            return lines
        problem = check_schedule(self.pipeline_schedule, pp_size, self.num_micro_batches, self.virtual_stages)
        if problem:
            raise ConfigError(problem)
        return []

    def check_context(self, cp_size: int) -> list[str]:
        """Lines to report for context-parallel settings that do nothing at ``cp_size = 1``."""
        if cp_size == 1 and self.cp_comm_type != "p2p":
            return [f"mtk: cp_comm_type={self.cp_comm_type} does nothing at cp = 1"]
        return []

    @property
    def recompute(self) -> str | None:
        """The recompute granularity in force: ``None`` (off), ``full`` or ``selective``."""
        if self.recompute_granularity:
            return self.recompute_granularity
        return "selective" if self.recompute_activations else None

    def __post_init__(self) -> None:
        if not isinstance(self.num_micro_batches, int) or self.num_micro_batches < 1:
            raise ConfigError(f"num_micro_batches must be a positive integer, got {self.num_micro_batches!r}")
        if not self.gradient_clipping >= 0 or math.isinf(self.gradient_clipping):  # NaN fails >= too
            raise ConfigError(
                f"gradient_clipping must be a finite number >= 0 (0 disables it), got {self.gradient_clipping}"
            )
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise ConfigError(f"virtual_stages must be a positive integer, got {self.virtual_stages!r}")
        problem = check_schedule(self.pipeline_schedule, 1, 1, self.virtual_stages)
        if problem:
            raise ConfigError(problem)
        if self.virtual_stages > 1 and self.last_stage_layers is not None:
            raise ConfigError(
                "decoder_last_pipeline_num_layers with virtual stages: give every model chunk's layers with "
                "pipeline_layers instead"
            )
        if self.pipeline_layers and min(self.pipeline_layers) < 1:
            raise ConfigError(f"pipeline_layers {list(self.pipeline_layers)} must give every stage at least one layer")
        if self.last_stage_layers is not None and self.last_stage_layers < 1:
            raise ConfigError(f"decoder_last_pipeline_num_layers must be >= 1, got {self.last_stage_layers}")
        if self.pipeline_layers and self.last_stage_layers not in (None, self.pipeline_layers[-1]):
            raise ConfigError(
                f"pipeline_layers {list(self.pipeline_layers)} puts {self.pipeline_layers[-1]} layers on the last "
                f"stage, decoder_last_pipeline_num_layers says {self.last_stage_layers}; give one of them"
            )
        if self.recompute_granularity not in (None, *RECOMPUTE_GRANULARITIES):
            raise ConfigError(
                f"recompute_granularity {self.recompute_granularity!r} is unknown; "
                f"use one of {RECOMPUTE_GRANULARITIES}"
            )
        if self.recompute_method not in RECOMPUTE_METHODS:
            raise ConfigError(f"recompute_method {self.recompute_method!r} is unknown; use one of {RECOMPUTE_METHODS}")
        if self.recompute_num_layers < 1:
            raise ConfigError(f"recompute_num_layers must be >= 1, got {self.recompute_num_layers}")
        if self.recompute != "full" and (self.recompute_method != "uniform" or self.recompute_num_layers != 1):
            raise ConfigError(  # (Megatron's rule: they choose the blocks of a full recompute)
                f"recompute_method={self.recompute_method}, recompute_num_layers={self.recompute_num_layers} choose "
                f"the blocks of a full recompute, and this run's recompute is {self.recompute or 'off'}; set "
                "recompute_granularity to full, or remove them"
            )
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ConfigError(f"cp_comm_type {self.cp_comm_type!r} is unknown; use one of {CP_COMM_TYPES}")
        if self.loss_chunk_tokens is not None and self.loss_chunk_tokens < 0:
            raise ConfigError(
                f"loss_chunk_tokens must be 0 (off) or a number of tokens per chunk, got {self.loss_chunk_tokens}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **explicit: Any) -> RunSettings:
        """Explicit settings (``None`` = not given), else the launcher's variables, else the defaults."""
        sources = {
            "num_micro_batches": ("MEGATRON_LM_NUM_MICRO_BATCHES", _parse_int),
            "pipeline_schedule": ("MTK_PIPELINE_SCHEDULE", _parse_word),
            "pipeline_layers": ("MTK_PIPELINE_LAYERS", _parse_int_list),
            "virtual_stages": ("MTK_VIRTUAL_STAGES", _parse_int),
            "sequence_parallel": ("MEGATRON_LM_SEQUENCE_PARALLELISM", parse_bool),
            "gradient_clipping": ("MEGATRON_LM_GRADIENT_CLIPPING", _parse_float),
            "eod_mask_loss": ("MEGATRON_LM_EOD_MASK_LOSS", parse_bool),
            "last_stage_layers": ("MEGATRON_LM_DECODER_LAST_PIPELINE_NUM_LAYERS", _parse_int),
            "recompute_activations": ("MEGATRON_LM_RECOMPUTE_ACTIVATIONS", parse_bool),
            "recompute_granularity": ("MEGATRON_LM_RECOMPUTE_GRANULARITY", _parse_word),
            "recompute_method": ("MEGATRON_LM_RECOMPUTE_METHOD", _parse_word),
            "recompute_num_layers": ("MEGATRON_LM_RECOMPUTE_NUM_LAYERS", _parse_int),
            "use_distributed_optimizer": ("MEGATRON_LM_USE_DISTRIBUTED_OPTIMIZER", parse_bool),
            "loss_chunk_tokens": ("MTK_LOSS_CHUNK_TOKENS", _parse_int),
            "cp_comm_type": ("MTK_CP_COMM_TYPE", _parse_word),
        }
        return cls(**_resolve({}, os.environ if env is None else env, sources, explicit))
