"""Apply a :class:`~mtk.rules.base.RuleSet` to an HF model: the one generic conversion function.

``parallelize_with(model, state, rule_set)`` replaces the modules the rules name by parallel layers holding this
rank's shard, fixes per-rank attributes, keeps tied embeddings tied, and installs the vocab-parallel
loss. A model on the meta device is converted without allocating anything (its shards are then
filled by :func:`mtk.checkpoint.hf_load.load_pretrained_tp`); a materialized model has each shard
copied from its full weight. :func:`mtk.convert.parallelize` is the entry point that calls it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from mtk.parallel.async_tp import enter_overlapped
from mtk.parallel.comm import gather_from_sequence
from mtk.parallel.embedding import VocabParallelEmbedding
from mtk.parallel.experts import split_experts
from mtk.parallel.grads import share_params_across_tp
from mtk.parallel.layers import ColumnParallelLinear, KVReplicatedColumnLinear, RowParallelLinear, ShardedModule
from mtk.parallel.norms import SplitRMSNorm
from mtk.parallel.parameters import copy_param_info
from mtk.parallel.state import ParallelState
from mtk.rules.base import (
    COLUMN,
    EXPERTS,
    KV_COLUMN,
    LM_HEAD,
    ROW,
    SPLIT_NORM,
    TP_SHARED,
    VOCAB,
    HeadCounts,
    Rule,
    RuleSet,
    UnsupportedModelError,
    compile_pattern,
)
from mtk.rules.lm_head import LogitsGatherHook, VocabParallelCausalLMLoss

__all__ = ["RuleContext", "materialize_", "parallelize_with"]


@dataclass(frozen=True)
class RuleContext:
    """Per-rank sizes the rules and attribute fix-ups are written in."""

    config: object
    tp_size: int
    counts: HeadCounts

    @property
    def heads_local(self) -> int:
        return self.counts.num_heads // self.tp_size

    @property
    def kv_copies(self) -> int:
        """Ranks holding each kv head: 1 when kv heads are split, tp / n_kv when replicated."""
        kv = self.counts.num_kv_heads
        return 1 if kv % self.tp_size == 0 else self.tp_size // kv

    @property
    def kv_local(self) -> int:
        return max(self.counts.num_kv_heads // self.tp_size, 1)

    @property
    def head_dim(self) -> int:
        return self.counts.head_dim

    @property
    def hidden_local(self) -> int:
        return self.heads_local * self.counts.head_dim

    def local_config(self):
        """A shallow copy of the config with per-rank head counts, for modules that read heads from it."""
        local = copy.copy(self.config)
        local.num_attention_heads = self.heads_local
        local.num_key_value_heads = self.kv_local
        return local


def materialize_(module: nn.Module, device: torch.device | str) -> None:
    """Give every meta parameter real (uninitialized) storage on ``device``, keeping its attributes."""
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            if param.device.type == "meta":
                real = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                copy_param_info(param, real)
                setattr(sub, name, real)


def _linear_dims(module: nn.Module, name: str) -> tuple[int, int, bool, bool]:
    """(in_features, out_features, has_bias, transposed) of an nn.Linear or HF Conv1D."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, module.bias is not None, False
    if type(module).__name__ == "Conv1D":  # transformers.pytorch_utils.Conv1D: weight [in, out]
        n_in, n_out = cast(torch.Tensor, module.weight).shape
        return n_in, n_out, module.bias is not None, True
    raise UnsupportedModelError(f"{name} is a {type(module).__name__}; a linear rule needs nn.Linear or Conv1D")


class CopyInputToTP:
    """Forward pre-hook of a :class:`~mtk.rules.base.SharedInput` module: its input enters the TP
    region once (``copy_to_tp``: identity forward, one all-reduce of the summed input gradient in
    backward) for all the column-parallel layers it feeds, which then skip their own copy. Under
    sequence parallelism the input arrives split along the sequence and is all-gathered instead
    (backward: one reduce-scatter), so the module runs HF's code on the whole sequence."""

    def __init__(self, argument: str, tp_group, sequence_parallel: bool = False) -> None:
        self.argument, self.tp_group, self.sequence_parallel = argument, tp_group, sequence_parallel

    def _enter(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return gather_from_sequence(x, self.tp_group)  # [b, s/tp, h] -> [b, s, h]
        columns = [m for m in module.modules() if isinstance(m, ColumnParallelLinear) and not m.copy_input]
        weights = [cast(torch.Tensor, c.weight) for c in columns if c.defers_weight_gradient]
        return enter_overlapped(x, self.tp_group, weights)  # the columns' weight gradients overlap the all-reduce

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (self._enter(module, args[0]), *args[1:]), kwargs
        if self.argument not in kwargs:
            raise UnsupportedModelError(
                f"{type(module).__name__} was called without {self.argument!r}, the input its shared_inputs rule names"
            )
        return args, {**kwargs, self.argument: self._enter(module, kwargs[self.argument])}


def _embed_scale(module: nn.Module) -> float | None:
    """The factor a scaled embedding (Gemma's, BART's: an ``nn.Embedding`` subclass) multiplies lookups by."""
    scale = getattr(module, "scalar_embed_scale", None)  # Gemma keeps a float beside the (possibly meta) buffer
    scale = getattr(module, "embed_scale", None) if scale is None else scale
    if scale is None:
        return None
    if torch.is_tensor(scale) and scale.device.type == "meta":
        raise UnsupportedModelError(f"{type(module).__name__}: its embed_scale is on the meta device; load it first")
    return float(scale.item()) if torch.is_tensor(scale) else float(scale)


def _build(
    rule: Rule,
    module: nn.Module,
    name: str,
    ctx: RuleContext,
    parallel: ParallelState,
    pad: int,
    copy_input: bool,
    sequence_parallel: bool = False,
) -> ShardedModule:
    """The parallel replacement for ``module`` (on the meta device: shards are filled afterwards)."""
    group = parallel.tp_group
    meta: dict[str, Any] = {"device": "meta", "dtype": None}
    if rule.style == SPLIT_NORM:
        weight = cast(torch.Tensor, module.weight)
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
        return SplitRMSNorm(weight.shape[0], eps, tp_group=group, device="meta", dtype=weight.dtype)
    if rule.style == VOCAB:
        if not isinstance(module, nn.Embedding):
            raise UnsupportedModelError(f"{name} is a {type(module).__name__}; the vocab rule needs nn.Embedding")
        meta["dtype"] = module.weight.dtype
        return VocabParallelEmbedding(
            module.num_embeddings,
            module.embedding_dim,
            module.padding_idx,
            tp_group=group,
            pad_to_multiple_of=pad,
            embed_scale=_embed_scale(module),
            **meta,
        )
    n_in, n_out, bias, transposed = _linear_dims(module, name)
    meta["dtype"] = module.weight.dtype
    if rule.style == COLUMN:
        parts = rule.parts(ctx.config) if rule.parts else None
        return ColumnParallelLinear(
            n_in,
            n_out,
            bias,
            tp_group=group,
            output_sizes=parts,
            transposed=transposed,
            gather_output=rule.gather_output,
            copy_input=copy_input,
            **meta,
        )
    if rule.style == KV_COLUMN:
        if ctx.kv_copies == 1:
            return ColumnParallelLinear(
                n_in, n_out, bias, tp_group=group, transposed=transposed, copy_input=copy_input, **meta
            )
        kv_group = parallel.tp_subgroup(ctx.kv_copies)
        return KVReplicatedColumnLinear(
            n_in,
            ctx.counts.num_kv_heads,
            ctx.head_dim,
            bias,
            tp_group=group,
            kv_group=kv_group,
            transposed=transposed,
            copy_input=copy_input,
            **meta,
        )
    if rule.style == ROW:
        return RowParallelLinear(
            n_in,
            n_out,
            bias,
            tp_group=group,
            input_is_parallel=not rule.split_input,
            transposed=transposed,
            sequence_parallel=sequence_parallel,
            **meta,
        )
    if rule.style == LM_HEAD:
        return ColumnParallelLinear(
            n_in,
            n_out,
            bias,
            tp_group=group,
            pad_to_multiple_of=pad,
            transposed=transposed,
            gather_output=rule.gather_output,
            **meta,
        )
    raise AssertionError(f"unhandled style {rule.style}")


def _copy_shards(new: ShardedModule, old: nn.Module) -> None:
    """Materialize ``new`` where ``old`` lives and copy this rank's slice of ``old``'s weights."""
    device = cast(torch.Tensor, old.weight).device
    if device.type == "meta":
        return
    materialize_(new, device)
    with torch.no_grad():
        for name, param in new.named_parameters(recurse=False):
            param.copy_(new.shard(getattr(old, name).detach(), name))


def _matches(pattern, name: str) -> bool:
    return pattern is not None and pattern.match(name) is not None


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def parallelize_with(
    model: nn.Module,
    parallel: ParallelState,
    rule_set: RuleSet,
    *,
    logits: str = "auto",
    pad_vocab_to_multiple_of: int = 1,
    sequence_parallel: bool = False,
) -> nn.Module:
    """Convert ``model`` in place with an explicit ``rule_set`` (no rules lookup, no parity check).

    ``sequence_parallel``: row-parallel layers reduce-scatter along the sequence and shared inputs
    all-gather it (:func:`mtk.convert.regions.apply_regions` then splits the blocks' input).
    """
    sequence_parallel = sequence_parallel and parallel.tp_size > 1
    config = model.config
    counts = rule_set.head_counts(config)
    problem = counts.problem(parallel.tp_size)
    if problem:
        raise UnsupportedModelError(
            f"{type(model).__name__}: {problem}; valid tp sizes for this model: {counts.valid_tp_sizes(limit=64)}"
        )
    ctx = RuleContext(config=config, tp_size=parallel.tp_size, counts=counts)
    embed_pattern = compile_pattern(rule_set.embedding) if rule_set.embedding else None
    modules = dict(model.named_modules())
    old_embedding = next((m.weight for n, m in modules.items() if embed_pattern and embed_pattern.match(n)), None)
    tied_heads = [
        n
        for n, m in modules.items()
        if old_embedding is not None and getattr(m, "weight", None) is old_embedding and not _matches(embed_pattern, n)
    ]

    shared = {n: s for n in modules for s in rule_set.shared_inputs if s.matches(n)} if parallel.tp_size > 1 else {}
    matched: set[str] = set()
    converted: dict[str, ShardedModule] = {}
    styles: dict[str, str] = {}  # converted module -> its rule's style
    for name, module in modules.items():
        rule = rule_set.rule_for(name) if name else None
        if rule is None:
            continue
        matched.add(rule.pattern)
        if rule.style == TP_SHARED:
            share_params_across_tp(module, [n for n, _ in module.named_parameters(recurse=False)], parallel.tp_group)
            continue
        if rule.style == EXPERTS:
            split_experts(module, parallel.tp_group, getattr(config, "moe_intermediate_size", None))
            styles[name] = rule.style
            continue
        fed_by_shared = rule.style in (COLUMN, KV_COLUMN) and any(name.startswith(p + ".") for p in shared)
        if sequence_parallel and rule.style in (COLUMN, KV_COLUMN) and not fed_by_shared:
            raise UnsupportedModelError(
                f"sequence parallelism: {name} is a column-parallel layer whose module is not in the "
                f"{rule_set.name} rules' shared_inputs, so nothing gathers its sequence; turn sequence parallelism "
                "off for this model"
            )
        new = _build(rule, module, name, ctx, parallel, pad_vocab_to_multiple_of, not fed_by_shared, sequence_parallel)
        _copy_shards(new, module)
        styles[name] = rule.style
        _set_submodule(model, name, new)
        converted[name] = new
    missing = [r.pattern for r in rule_set.rules if not r.optional and r.pattern not in matched]
    if missing:
        raise UnsupportedModelError(
            f"{type(model).__name__}: the {rule_set.name} rules {missing} match no module; this model needs its own "
            f"rule file under mtk/rules/ (docs/architectures.md, 'Adding an architecture')"
        )
    if parallel.tp_size > 1 and not any(style in (COLUMN, KV_COLUMN, ROW, EXPERTS) for style in styles.values()):
        raise UnsupportedModelError(f"{type(model).__name__}: the {rule_set.name} rules split no linear layer here")
    untied = [n for n in tied_heads if n not in converted]
    if untied:
        raise UnsupportedModelError(f"{untied} are tied to the input embedding but no rule splits them")
    for name, spec in shared.items():
        hook = CopyInputToTP(spec.argument, parallel.tp_group, sequence_parallel)
        modules[name].register_forward_pre_hook(hook, with_kwargs=True)
    _retie_embeddings(model, converted, styles, old_embedding, tied_heads)
    for name, module in model.named_modules():
        for fix in rule_set.attr_fixes:
            if fix.matches(name) and hasattr(module, fix.attr):
                setattr(module, fix.attr, fix.value(ctx))
    heads = [cast(ColumnParallelLinear, m) for n, m in converted.items() if styles[n] == LM_HEAD]
    head = next((m for m in heads if not m.gather_output), None)
    if head is not None:
        cast(Any, model).loss_function = VocabParallelCausalLMLoss(head)
        model.register_forward_hook(LogitsGatherHook(head, logits), with_kwargs=True)
    return model


def _retie_embeddings(
    model: nn.Module, converted: dict, styles: dict[str, str], old_embedding, tied_heads: list[str]
) -> None:
    """Output embeddings that shared the input embedding's weight share its shard after conversion.

    Ties are found by parameter identity before conversion (what HF's ``tie_weights`` produced), so
    an untied model stays untied whatever its config says.
    """
    if old_embedding is None:
        return
    for name, param in model.named_parameters(remove_duplicate=False):
        if param is old_embedding:
            raise UnsupportedModelError(
                f"{name} is tied to the input embedding but no rule splits it; add an lm_head rule for it"
            )
    embedding = next((m for n, m in converted.items() if styles[n] == VOCAB), None)
    for name in tied_heads:
        head = converted[name]
        if embedding is None or head.weight.shape != embedding.weight.shape:
            raise UnsupportedModelError(f"{name} cannot stay tied to the vocab-parallel embedding: shards differ")
        head.weight = embedding.weight
