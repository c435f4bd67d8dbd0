"""Layer-replacement rules as data: module-name patterns mapped to a parallel style.

A :class:`RuleSet` is a small value: which modules of an HF architecture become which parallel layer,
which attributes of HF's own modules change (heads per rank), and how to read head counts from the
config for validation. One generic function (:func:`mtk.convert.parallelize`) applies any rule set,
and HF's forward code (rotary, sdpa/eager attention, masks) keeps running on the converted modules.

Patterns name modules by their dotted path: ``*`` matches one path component, a leading ``**.``
matches any prefix (so one rule covers ``LlamaModel`` and ``LlamaForCausalLM``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from mtk.errors import UnsupportedModelError
from mtk.rules.styles import (
    COLUMN,
    EXPERTS,
    KV_COLUMN,
    LM_HEAD,
    ROW,
    SPLIT_NORM,
    STYLES,
    TP_SHARED,
    VOCAB,
    ParallelStyle,
)

__all__ = [
    "COLUMN",
    "EXPERTS",
    "KV_COLUMN",
    "LM_HEAD",
    "ROW",
    "STYLES",
    "SPLIT_NORM",
    "TP_SHARED",
    "VOCAB",
    "AttrFix",
    "HeadCounts",
    "ParallelStyle",
    "PipelineSpec",
    "RuleSet",
    "Rule",
    "SharedInput",
    "UnsupportedModelError",
    "compile_pattern",
]

# What a module that belongs to another pipeline stage becomes on this one.
REMOVE = "remove"  # dropped: the input embedding (later stages pass ``inputs_embeds``) or the LM head
IDENTITY = "identity"  # returns its input: the final norm before the last stage, embedding dropout after the first
ZEROS = "zeros"  # returns zeros shaped like its output: learned positions added to the embeddings
STAGE_REPLACEMENTS = (REMOVE, IDENTITY, ZEROS)


@cache
def compile_pattern(pattern: str) -> re.Pattern:
    """``**.layers.*.mlp.up_proj`` -> regex matching ``model.layers.3.mlp.up_proj`` and ``layers.0.mlp.up_proj``."""
    prefix = ""
    if pattern.startswith("**."):
        prefix, pattern = r"(?:.*\.)?", pattern[3:]
    parts = [r"[^.]+" if p == "*" else re.escape(p) for p in pattern.split(".")]
    return re.compile(prefix + r"\.".join(parts) + "$")


@dataclass(frozen=True)
class HeadCounts:
    """The sizes a TP degree must divide (or, for kv heads, be a multiple of)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int | None = None
    allow_kv_replication: bool = True  # False when k/v live in a fused projection with q
    no_replication_reason: str = "fused qkv projection"

    def valid_tp_sizes(self, limit: int = 64) -> list[int]:
        return [tp for tp in range(1, limit + 1) if not self.problem(tp)]

    def problem(self, tp: int) -> str | None:
        """Why ``tp`` cannot split this model, or ``None`` when it can."""
        if self.num_heads % tp:
            return f"num_attention_heads = {self.num_heads} is not divisible by tp = {tp}"
        if self.num_kv_heads % tp and not self.allow_kv_replication:
            reason = self.no_replication_reason
            return f"num_key_value_heads = {self.num_kv_heads} is not divisible by tp = {tp} ({reason})"
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            return (
                f"num_key_value_heads = {self.num_kv_heads} neither divides nor is divided by tp = {tp} "
                f"(kv heads are split when tp divides them, replicated when tp is a multiple of them)"
            )
        if self.intermediate_size is not None and self.intermediate_size % tp:
            return f"intermediate_size = {self.intermediate_size} is not divisible by tp = {tp}"
        return None


@dataclass(frozen=True)
class Rule:
    """Modules whose dotted name matches ``pattern`` become ``style``.

    Attributes:
        pattern: module path pattern (``*`` one component, leading ``**.`` any prefix).
        style: a :class:`~mtk.rules.styles.ParallelStyle` (``COLUMN``, ``ROW``, ...) or a registered style's name.
        parts: for a fused column: the sizes of its parts, from the config (e.g. ``[E, E, E]`` for
            GPT-2's ``c_attn``), so each part is split on its own.
        gather_output: gather the column's output (a head whose HF loss needs full logits).
        optional: the rule may match nothing (e.g. Qwen3's q/k norms in a Qwen2 model).
        split_input: a row whose input arrives whole (after a gathered column): it cuts its slice first.
    """

    pattern: str
    style: ParallelStyle
    parts: Callable[[Any], list[int]] | None = None
    gather_output: bool = False
    optional: bool = False
    split_input: bool = False

    def __post_init__(self) -> None:
        style = STYLES.get(self.style, self.style) if isinstance(self.style, str) else self.style
        if not isinstance(style, ParallelStyle):
            raise ValueError(f"unknown style {self.style!r}; expected one of {tuple(STYLES)}")
        object.__setattr__(self, "style", style)  # a name becomes its registered style

    def matches(self, name: str) -> bool:
        return compile_pattern(self.pattern).match(name) is not None


@dataclass(frozen=True)
class SharedInput:
    """A module whose input feeds only column-parallel layers (attention's q/k/v, the MLP's gate/up).

    The input is copied to the TP region once, by a forward pre-hook on the module, instead of once
    per column: their input gradients are summed locally and all-reduced once, as a fused projection
    would be. Name a module here only when its input reaches nothing but those columns (a residual
    inside it would be all-reduced too).

    Attributes:
        pattern: module path pattern (as in :class:`Rule`).
        argument: the input's keyword name, used when the module is called without positional arguments
            (``None``: the first parameter of the module's ``forward``, for rules written without the module).
    """

    pattern: str
    argument: str | None = "hidden_states"

    def matches(self, name: str) -> bool:
        return compile_pattern(self.pattern).match(name) is not None


@dataclass(frozen=True)
class AttrFix:
    """Set ``attr`` on modules matching ``pattern`` to ``value(ctx)`` (e.g. heads per rank)."""

    pattern: str
    attr: str
    value: Callable[[Any], Any]

    def matches(self, name: str) -> bool:
        return compile_pattern(self.pattern).match(name) is not None


@dataclass(frozen=True)
class PipelineSpec:
    """How a decoder's HF forward is cut into pipeline stages without rewriting it.

    Every stage runs the HF model's own forward (positions, rotary embeddings and masks are computed
    by HF's code on every stage); the decoder blocks of other stages become pass-throughs, and the
    modules named here are replaced on the stages that do not own them.

    Attributes:
        layers: pattern of the ``nn.ModuleList`` of decoder blocks, cut into contiguous stages.
        first_stage: ``{pattern: replacement}`` for modules only the first stage runs (embeddings).
        last_stage: ``{pattern: replacement}`` for modules only the last stage runs (final norm, head).
    """

    layers: str
    first_stage: tuple[tuple[str, str], ...]
    last_stage: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        for pattern, replacement in self.first_stage + self.last_stage:
            if replacement not in STAGE_REPLACEMENTS:
                raise ValueError(f"{pattern}: unknown stage replacement {replacement!r}; use {STAGE_REPLACEMENTS}")


@dataclass(frozen=True)
class RuleSet:
    """Everything mtk needs to know to make one architecture family tensor-parallel.

    Attributes:
        name: family name shown in messages.
        model_types: HF ``config.model_type`` values these rules serve.
        rules: module-name rules, first match wins.
        attr_fixes: attribute fix-ups on HF's own modules after conversion.
        head_counts: reads the sizes TP must divide from the config.
        embedding: pattern of the input embedding (for tying with the LM head).
        pipeline: how to cut the model into pipeline stages (``None``: pipeline parallelism unsupported).
        shared_inputs: modules whose input is copied to the TP region once for all their columns; under
            sequence parallelism, where the sequence is all-gathered (every column must be fed by one,
            since HF's modules read the sequence length from their input).
        layers: the ``nn.ModuleList`` of transformer blocks (the sequence-parallel region, recompute);
            default: the pipeline's.
        split_random: modules whose random draws fall on TP-split activations (attention dropout on
            this rank's heads): they draw from the per-TP-rank stream.
        residual_dropouts: dropouts on the residual stream inside the blocks: replicated without
            sequence parallelism (the shared stream, also inside a ``split_random`` module), split along
            the sequence with it (the TP stream).
        sequence_parallel: whether these rules are checked exact under sequence parallelism (``False``: it is
            refused in one line, even where the shared inputs would gather every column's sequence).
    """

    name: str
    model_types: tuple[str, ...]
    rules: tuple[Rule, ...]
    head_counts: Callable[[Any], HeadCounts]
    attr_fixes: tuple[AttrFix, ...] = ()
    embedding: str | None = None
    pipeline: PipelineSpec | None = None
    shared_inputs: tuple[SharedInput, ...] = ()
    layers: str | None = None
    split_random: tuple[str, ...] = ()
    residual_dropouts: tuple[str, ...] = ()
    sequence_parallel: bool = True
    notes: str = field(default="", compare=False)

    @property
    def blocks(self) -> str | None:
        """Pattern of the ``nn.ModuleList`` of transformer blocks, if the rules know it."""
        return self.layers or (self.pipeline.layers if self.pipeline else None)

    def rule_for(self, name: str) -> Rule | None:
        for rule in self.rules:
            if rule.matches(name):
                return rule
        return None
