"""Plans built from the metadata transformers ships with each architecture: ``base_model_tp_plan`` (module
pattern -> style) and ``base_model_pp_plan`` (embedding -> layers -> final norm).

The model authors maintain that metadata for every new architecture, so an architecture that ships it needs no
code in mtk. HF's styles map onto mtk's:

==============================  ==========================================================================
HF style                        mtk
==============================  ==========================================================================
``colwise``                     column-parallel (a k/v projection: by kv heads, replicated when tp > kv)
``rowwise``                     row-parallel
``packed_colwise`` (dense)      column-parallel split per part (``gate_up_proj``: two halves)
``colwise_gather_output``       column-parallel whose output is gathered (what follows needs every column,
                                e.g. OLMo2's q/k norms over the whole projection): exact, no memory saved
                                on the attention itself
``rowwise_split_input``         row-parallel that cuts its (gathered) input first
``replicated_with_grad_allreduce``  replicated, gradient summed over TP (norms over split heads)
``embedding_rowwise``           vocabulary-parallel embedding
==============================  ==========================================================================

The input embedding (the pp rule set's first module) is always vocabulary-parallel and the causal-LM head
(``lm_head`` in the model class's ``_tp_plan``) vocabulary-parallel with mtk's loss, which never gathers the
logits. Any other style (MoE experts, MLA projections, ...) makes :func:`hf_plan` say why it cannot, and the
registry falls back to the generic rules. Every rule_set built here passes the same one-layer parity check as the
generic rules before it converts a model (:func:`mtk.rules.registry.resolve_rules`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mtk.rules.base import (
    COLUMN,
    EXPERTS,
    IDENTITY,
    KV_COLUMN,
    LM_HEAD,
    REMOVE,
    ROW,
    TP_SHARED,
    VOCAB,
    AttrFix,
    PipelineSpec,
    Rule,
    RuleSet,
    SharedInput,
)
from mtk.rules.llama import llama_head_counts

__all__ = ["SUPPORTED_STYLES", "rules_from_tp_plan"]

KV_NAMES = ("k_proj", "v_proj", "key", "value", "k", "v")


def _gate_up_parts(config: Any) -> list[int]:
    return [config.intermediate_size] * 2


# HF style -> the options of mtk's rule for it
_RULE_OPTIONS: dict[str, dict[str, Any]] = {
    "colwise": {"style": COLUMN},  # a k/v projection: KV_COLUMN (_rule)
    "rowwise": {"style": ROW},
    "packed_colwise": {"style": COLUMN, "parts": _gate_up_parts},  # a fused gate/up: each half split on its own
    "colwise_gather_output": {"style": COLUMN, "gather_output": True},
    "rowwise_split_input": {"style": ROW, "split_input": True},
    "replicated_with_grad_allreduce": {"style": TP_SHARED},
    "embedding_rowwise": {"style": VOCAB},
    "moe_tp_experts": {"style": EXPERTS},
}
SUPPORTED_STYLES = tuple(_RULE_OPTIONS)


def _rule(pattern: str, style: str) -> Rule:
    """mtk's rule for one entry of HF's tp plan (a style :data:`SUPPORTED_STYLES` lists). Optional: a hybrid
    model's attention rules match only its attention layers (at least one split layer is required)."""
    rule = Rule(f"**.{pattern}", optional=True, **_RULE_OPTIONS[style])
    if style == "colwise" and pattern.rpartition(".")[2] in KV_NAMES:  # by kv heads, replicated when tp > kv
        return replace(rule, style=KV_COLUMN)
    return rule


_COLUMNS = ("colwise", "packed_colwise", "colwise_gather_output")


def _shared_inputs(tp_plan: dict[str, str]) -> tuple[SharedInput, ...]:
    """A module holding two column-parallel linears or more (attention's q/k/v, the MLP's gate/up) takes their
    input into the TP region once: one backward all-reduce for all of them, as with mtk's own rules. HF's plan
    does not say whether that input also feeds something else inside the module (which would then be summed over
    TP); the parity check compares every gradient before such rules convert a model (``mtk.rules.registry``). An
    MoE block is never one: its input feeds the router too (Qwen3-MoE's ``mlp`` names the gate/up of its dense
    layers and the experts of its sparse ones)."""
    columns: dict[str, int] = {}
    for pattern, style in tp_plan.items():
        if style in _COLUMNS:
            parent = pattern.rpartition(".")[0]
            columns[parent] = columns.get(parent, 0) + 1
    moe_blocks = {pattern.rpartition(".")[0] for pattern, style in tp_plan.items() if style == "moe_tp_experts"}
    return tuple(
        SharedInput(f"**.{parent}", argument=None)
        for parent, count in columns.items()
        if count > 1 and parent not in moe_blocks
    )


def _pipeline(pp_plan: dict[str, Any]) -> PipelineSpec | None:
    """Stages from HF's ``embedding -> ... -> layers -> ...``: the embedding is removed after the first stage,
    other modules before the layers (embedding dropout) pass through there, those after them (final norm)
    pass through before the last stage; ``None`` for any other shape."""
    names = list(pp_plan)
    if "layers" not in names or not names or "input_ids" not in pp_plan[names[0]][0]:
        return None
    split = names.index("layers")
    before, after = names[1:split], names[split + 1 :]
    return PipelineSpec(
        layers="**.layers",
        first_stage=((f"**.{names[0]}", REMOVE), *((f"**.{n}", IDENTITY) for n in before)),
        last_stage=(*((f"**.{n}", IDENTITY) for n in after), ("lm_head", REMOVE)),
    )


def rules_from_tp_plan(config: Any) -> tuple[RuleSet | None, str]:
    """The rules HF's metadata gives ``config``'s architecture, or ``(None, why not)``."""
    tp_plan: dict[str, str] = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not tp_plan:
        return None, f"{config.model_type} ships no base_model_tp_plan"
    unsupported = sorted({style for style in tp_plan.values() if style not in SUPPORTED_STYLES})
    if unsupported:
        return None, f"{config.model_type}'s base_model_tp_plan uses {', '.join(unsupported)} (mtk does not split it)"
    experts = {p for p, s in tp_plan.items() if s == "moe_tp_experts"}
    # an expert's tensors are the experts module's own parameters, cut with it (not modules of their own)
    tp_plan = {p: s for p, s in tp_plan.items() if p.rpartition(".")[0] not in experts}
    pp_plan = dict(getattr(config, "base_model_pp_plan", None) or {})
    embedding = next(iter(pp_plan), "embed_tokens")
    rules = [_rule(pattern, style) for pattern, style in tp_plan.items()]
    # A learnable activation between a split column and its row (Apertus' xIELU) sees this rank's columns
    # only: its parameters' gradients are partial sums (HF's tp plan leaves them replicated, unsummed).
    split_mlps = {p.rpartition(".")[0] for p, s in tp_plan.items() if s in ("colwise", "packed_colwise")}
    rules += [Rule(f"**.{parent}.act_fn", TP_SHARED, optional=True) for parent in sorted(split_mlps)]
    if not any(rule.matches(f"model.{embedding}") for rule in rules):
        rules.append(Rule(f"**.{embedding}", VOCAB, optional=True))
    rules.append(Rule("lm_head", LM_HEAD, optional=True))
    # attention split by heads (not gathered): HF's per-rank head counts and dropout on this rank's heads
    split_heads = sorted(
        {p.rpartition(".")[0] for p, s in tp_plan.items() if s == "colwise" and p.rpartition(".")[2] in ("q_proj",)}
    )
    fixes = tuple(
        AttrFix(f"**.{parent}", attr, value)
        for parent in split_heads
        for attr, value in (
            ("num_key_value_groups", lambda ctx: ctx.heads_local // ctx.kv_local),
            ("num_heads", lambda ctx: ctx.heads_local),
            ("num_key_value_heads", lambda ctx: ctx.kv_local),
        )
    )
    rule_set = RuleSet(
        name=f"{config.model_type} (transformers' base_model_tp_plan)",
        shared_inputs=_shared_inputs(tp_plan),
        sequence_parallel=False,
        model_types=(config.model_type,),
        rules=tuple(rules),
        head_counts=llama_head_counts,
        attr_fixes=fixes,
        embedding=f"**.{embedding}",
        pipeline=_pipeline(pp_plan) if pp_plan else None,
        split_random=tuple(f"**.{parent}" for parent in split_heads),
    )
    return rule_set, ""
