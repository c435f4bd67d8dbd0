"""What context parallelism adds to a plan: the CP attention's own memory, its collectives and their time, and
which models it can run at all (``mtk plan --cp``; docs/long_context.md)."""

from __future__ import annotations

from transformers import PretrainedConfig

from mtk.models import attention_heads
from mtk.parallel.router_loss import router_loss_refusal
from mtk.planner.collectives import Predicted, predict_context_collectives
from mtk.planner.layouts import Candidate, Request
from mtk.planner.shapes import router_experts
from mtk.planner.timing import collective_seconds
from mtk.rules.registry import find_rules

__all__ = ["attention_workspace", "context_collectives", "context_parallel_refusal", "context_traffic"]


def attention_workspace(request: Request, c: Candidate, rank_seq: int) -> int:
    """Bytes per sequence context-parallel attention holds at its backward's peak besides the trace's activations:
    two fp32 score blocks of this TP rank's heads (``[h/tp, s/cp, s/cp]`` per ring step; all-to-all: ``[h/(tp cp),
    s, s]`` at once) and the block's boolean mask (mtk.parallel.ring_attention). ``rank_seq``: a rank's tokens."""
    if c.cp_size == 1:
        return 0
    heads = attention_heads(request.config)[0] // c.tp_size
    queries = keys = rank_seq
    if request.cp_comm == "a2a":
        heads, queries, keys = max(heads // c.cp_size, 1), request.seq, request.seq
    return heads * queries * keys * 2 * 4 + queries * keys


def context_collectives(request: Request, c: Candidate, stage_layers: int, element_size: int) -> Predicted:
    """The CP attention's collectives per step on a rank of a stage of ``stage_layers`` decoder layers: every
    micro-batch's forward and backward (nothing at ``cp = 1``)."""
    heads, kv_heads, head_dim = attention_heads(request.config)
    context = predict_context_collectives(  # one micro-batch
        stage_layers,
        c.micro_batch_size,
        request.seq,
        c.cp_size,
        request.cp_comm,
        heads // c.tp_size,
        max(1, kv_heads // c.tp_size),
        head_dim,
        element_size,
        recompute=c.recompute is not None,
        router_experts=router_experts(request.config),
    )
    for kind in list(context.counts):
        context.counts[kind] *= c.micro_batches
        context.nbytes[kind] *= c.micro_batches
    return context


def context_traffic(context: Predicted, comm: str, cp_size: int, bandwidth: float) -> tuple[int, float]:
    """Bytes a rank moves over its CP group per step (the ring's sends or the all-to-alls, and the metadata
    gathers) and their seconds on the wire."""
    moved = context.nbytes["send" if comm == "p2p" else "all_to_all"] + context.nbytes["all_gather"]
    seconds = sum(
        collective_seconds(kind, context.nbytes[kind], cp_size, bandwidth)
        for kind in ("send", "all_to_all", "all_gather")
    )
    return moved, seconds


def context_parallel_refusal(config: PretrainedConfig) -> str | None:
    """Why mtk's context-parallel attention cannot run ``config``'s model (``None``: it can), read on the config as
    the attention would refuse it at its first call (mtk.parallel.context)."""
    rule_set = find_rules(config)
    if rule_set is None or rule_set.pipeline is None:
        return f"{config.model_type} is not a decoder mtk cuts (context parallelism needs causal attention)"
    layer_types = getattr(config, "layer_types", None) or ()
    windowed = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if "sliding_attention" in layer_types or (windowed and not layer_types):
        return f"{config.model_type} attends through sliding windows, which context parallelism does not apply"
    if getattr(config, "attn_logit_softcapping", None):
        return f"{config.model_type} soft-caps its attention scores, which context parallelism does not apply"
    return router_loss_refusal(config)
