"""The one entry point that makes an HF model parallel: :func:`parallelize`.

Converting by the rules (tensor parallelism) and cutting into pipeline stages happen together, once,
here; the Accelerator, the HF-directory loader, the bench and the examples all call this function.
What it did is attached to the model as one record, :class:`Parallelized` (``parallelized(model)``):
the :class:`~mtk.rules.base.RuleSet` that converted it and the stage it holds.
"""

from __future__ import annotations

from torch import nn

from mtk.convert.regions import apply_regions
from mtk.convert.whole_outputs import answer_as_asked
from mtk.parallel.expert_parallel import spread_experts
from mtk.parallel.record import Parallelized, attach
from mtk.parallel.state import ParallelState
from mtk.pipeline.stages import split_stages
from mtk.rules import RuleSet, check_tp_size, parallelize_with, resolve_rules

__all__ = ["parallelize"]


def _on_meta(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def parallelize(
    model: nn.Module,
    parallel: ParallelState,
    *,
    rule_set: RuleSet | None = None,
    pipeline_layers: tuple[int, ...] = (),
    virtual_stages: int = 1,
    logits: str = "auto",
    pad_vocab_to_multiple_of: int = 1,
    sequence_parallel: bool = False,
    loss_chunk_tokens: int | None = None,
) -> nn.Module:
    """Make an HF model tensor-parallel over ``parallel.tp_group`` (its experts spread over ``parallel.ep_group``
    when ep > 1) and cut it to this rank's pipeline stage.

    In place; returns the model. Works on a materialized model (shards are copied, other stages'
    weights freed) and on one on the meta device (nothing is allocated; a loader then reads only this
    rank's bytes).

    Args:
        model: an HF ``PreTrainedModel``.
        parallel: this process's topology.
        rule_set: rules to use; default: the registered rules for the model type, else the generic rules
            once they pass a parity check on a one-layer copy.
        pipeline_layers: decoder layers per stage (pp > 1); default: even with the LM head counted as layers
            of the last stage (:mod:`mtk.pipeline.balance`; :class:`~mtk.config.RunSettings` ``pipeline_layers``
            is what the Accelerator passes); with ``virtual_stages`` > 1, one count per model chunk.
        virtual_stages: model chunks per pipeline rank, for the interleaved schedule (1: one stage each).
        logits: ``auto`` (full logits when no labels are passed), ``full`` or ``shard``.
        pad_vocab_to_multiple_of: pad the vocabulary to a multiple of ``tp * this`` (never visible).
        sequence_parallel: split the activations between TP blocks along the sequence (Megatron's
            sequence parallelism; gradients of the blocks' replicated parameters are then summed over TP
            by :func:`~mtk.parallel.grads.sync_sequence_parallel_grads` after backward).
        loss_chunk_tokens: tokens per chunk of the training loss that never holds the ``[b, s, V/tp]`` logits
            (:mod:`mtk.parallel.chunked_loss`); ``None``: chunks of at most 256 MiB of fp32 logits; 0: off.
    """
    check_tp_size(model.config, parallel.tp_size)  # one clear line before any rank builds anything
    rule_set = rule_set or resolve_rules(model, parallel)
    sequence_parallel = sequence_parallel and parallel.tp_size > 1
    parallelize_with(
        model,
        parallel,
        rule_set,
        logits=logits,
        pad_vocab_to_multiple_of=pad_vocab_to_multiple_of,
        sequence_parallel=sequence_parallel,
        loss_chunk_tokens=loss_chunk_tokens,
    )
    if parallel.ep_size > 1 and not _on_meta(model):  # each MoE layer's experts over EP, after TP split each one
        spread_experts(model, parallel.ep_group)  # (a model read slice by slice is spread once read: hf_load)
    stage = split_stages(model, parallel, rule_set, pipeline_layers, virtual_stages) if parallel.pp_size > 1 else None
    chunks = stage.chunks if stage is not None and stage.virtual_stages > 1 else ()
    rng = apply_regions(model, rule_set, parallel, sequence_parallel=sequence_parallel, chunks=chunks)
    answer_as_asked(model)  # (the hooks above read outputs by name; a caller's tuple is made last)
    attach(model, Parallelized(rule_set, parallel.tp_size, stage, sequence_parallel, rng))
    return model
