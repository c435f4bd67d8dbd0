"""Apply a :class:`~mtk.rules.base.RuleSet` to an HF model: the one generic conversion function.

``parallelize_with(model, state, rule_set)`` replaces the modules the rules name by parallel layers holding this
rank's shard, fixes per-rank attributes, keeps tied embeddings tied, and installs the vocab-parallel
loss. A model on the meta device is converted without allocating anything (its shards are then
filled by :func:`mtk.checkpoint.hf_load.load_pretrained_tp`); a materialized model has each shard
copied from its full weight. :func:`mtk.convert.parallelize` is the entry point that calls it.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from mtk.errors import ConfigError
from mtk.parallel.async_tp import enter_overlapped
from mtk.parallel.comm import gather_from_sequence
from mtk.parallel.layers import ColumnParallelLinear, ShardedModule
from mtk.parallel.parameters import copy_param_info
from mtk.parallel.state import ParallelState
from mtk.rules.base import (
    LM_HEAD,
    VOCAB,
    HeadCounts,
    Rule,
    RuleSet,
    SharedInput,
    UnsupportedModelError,
    compile_pattern,
)
from mtk.rules.fused_head import FusedHeadGuard, needs_vocab_parallel_head, replace_trl_fused_head
from mtk.rules.lm_head import LogitsGatherHook, VocabParallelCausalLMLoss, attach_logits_hook, logits_transform

__all__ = ["BuildContext", "RuleContext", "materialize_", "parallelize_with"]


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


@dataclass(frozen=True)
class BuildContext:
    """What a :class:`~mtk.rules.styles.ParallelStyle` builds with: the per-rank sizes, the process groups
    and the conversion's options.

    Attributes:
        sizes: the per-rank head counts the rules are written in.
        parallel: the topology (``tp_group``, kv subgroups).
        rules_name: the rule set's name, for messages.
        pad_vocab_to_multiple_of: vocabulary padding of the embedding and the head, beyond a multiple of tp.
        sequence_parallel: row-parallel layers reduce-scatter along the sequence, columns need a shared input.
        shared_inputs: names of the modules whose input enters the TP region once for all their columns.
    """

    sizes: RuleContext
    parallel: ParallelState
    rules_name: str
    pad_vocab_to_multiple_of: int = 1
    sequence_parallel: bool = False
    shared_inputs: frozenset[str] = frozenset()

    def column_copies_input(self, name: str) -> bool:
        """Whether the column ``name`` copies its input into the TP region itself: not when a shared input's
        hook already did (under sequence parallelism one must, since it all-gathers the sequence)."""
        fed_by_shared = any(name.startswith(p + ".") for p in self.shared_inputs)
        if self.sequence_parallel and not fed_by_shared:
            raise UnsupportedModelError(
                f"sequence parallelism: {name} is a column-parallel layer whose module is not in the "
                f"{self.rules_name} rules' shared_inputs, so nothing gathers its sequence; turn sequence parallelism "
                "off for this model"
            )
        return not fed_by_shared


def materialize_(module: nn.Module, device: torch.device | str) -> None:
    """Give every meta parameter real (uninitialized) storage on ``device``, keeping its attributes."""
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            if param.device.type == "meta":
                real = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                copy_param_info(param, real)
                setattr(sub, name, real)


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


def _copy_shards(new: ShardedModule, old: nn.Module) -> None:
    """Materialize ``new`` where ``old`` lives and copy this rank's slice of ``old``'s weights."""
    device = cast(torch.Tensor, old.weight).device
    if device.type == "meta":
        return
    materialize_(new, device)
    with torch.no_grad():
        for name, param in new.named_parameters(recurse=False):
            param.copy_(new.shard(getattr(old, name).detach(), name))


def parallelize_with(
    model: nn.Module,
    parallel: ParallelState,
    rule_set: RuleSet,
    *,
    logits: str = "auto",
    pad_vocab_to_multiple_of: int = 1,
    sequence_parallel: bool = False,
    loss_chunk_tokens: int | None = None,
) -> nn.Module:
    """Convert ``model`` in place with an explicit ``rule_set`` (no rules lookup, no parity check).

    ``sequence_parallel``: row-parallel layers reduce-scatter along the sequence and shared inputs
    all-gather it (:func:`mtk.convert.regions.apply_regions` then splits the blocks' input).
    ``loss_chunk_tokens``: tokens per chunk of the training loss that never holds the logits (``None``: sized
    from the vocabulary; 0: the logits are computed, then the loss, as with any caller that asks for them).
    """
    sequence_parallel = sequence_parallel and parallel.tp_size > 1
    if sequence_parallel and not rule_set.sequence_parallel:
        raise UnsupportedModelError(
            f"sequence parallelism: the {rule_set.name} rules are not checked exact under it; turn "
            "megatron_lm_sequence_parallelism off for this model"
        )
    modules = dict(model.named_modules())
    shared = _shared_inputs(modules, rule_set) if parallel.tp_size > 1 else {}
    ctx = BuildContext(
        sizes=_rule_context(model, parallel.tp_size, rule_set),
        parallel=parallel,
        rules_name=rule_set.name,
        pad_vocab_to_multiple_of=pad_vocab_to_multiple_of,
        sequence_parallel=sequence_parallel,
        shared_inputs=frozenset(shared),
    )
    old_embedding, tied_heads = _tied_to_embedding(modules, rule_set)
    rules: dict[str, Rule] = {}  # every module a rule matched -> that rule
    converted: dict[str, nn.Module] = {}  # the modules replaced -> their replacement
    for name, module in modules.items():
        rule = rule_set.rule_for(name) if name else None
        if rule is None:
            continue
        rules[name] = rule
        new = rule.style.build(module, name, rule, ctx)
        if new is not None:
            if isinstance(new, ShardedModule):  # another replacement fills itself
                _copy_shards(new, module)
            model.set_submodule(name, new)
            converted[name] = new
    _check_coverage(model, rule_set, rules, parallel.tp_size)
    _hook_shared_inputs(modules, shared, ctx)
    _retie_embeddings(model, converted, rules, old_embedding, tied_heads)
    _fix_attributes(model, rule_set, ctx.sizes)
    _install_vocab_parallel_loss(model, converted, rules, logits, loss_chunk_tokens)
    _take_over_fused_head(model)
    return model


def _rule_context(model: nn.Module, tp_size: int, rule_set: RuleSet) -> RuleContext:
    """The per-rank sizes, once the model's head counts are checked against ``tp_size``."""
    counts = rule_set.head_counts(model.config)
    problem = counts.problem(tp_size)
    if problem:
        raise UnsupportedModelError(
            f"{type(model).__name__}: {problem}; valid tp sizes for this model: {counts.valid_tp_sizes(limit=64)}"
        )
    return RuleContext(config=model.config, tp_size=tp_size, counts=counts)


def _shared_inputs(modules: dict[str, nn.Module], rule_set: RuleSet) -> dict[str, SharedInput]:
    """The modules whose input is copied into the TP region once, for all their columns -> their spec. One derived
    from HF's plan (``argument`` None) only where every linear inside is one the rules split and no experts module
    is (a hybrid model's linear-attention layer shares the attention's name but holds whole linears)."""
    return {
        n: s
        for n in modules
        for s in rule_set.shared_inputs
        if s.matches(n) and (s.argument is not None or _only_split_linears(n, modules[n], rule_set))
    }


def _only_split_linears(name: str, module: nn.Module, rule_set: RuleSet) -> bool:
    for sub_name, sub in module.named_modules(prefix=name):
        if sub is module:
            continue
        if hasattr(sub, "num_experts"):
            return False
        if isinstance(sub, nn.Linear) or type(sub).__name__ == "Conv1D":
            rule = rule_set.rule_for(sub_name)
            if rule is None or not rule.style.splits_linear:
                return False
    return True


def _tied_to_embedding(modules: dict[str, nn.Module], rule_set: RuleSet) -> tuple[nn.Parameter | None, list[str]]:
    """The input embedding's weight and the other modules holding that same weight (tied heads)."""
    pattern = compile_pattern(rule_set.embedding) if rule_set.embedding else None
    if pattern is None:
        return None, []
    weight = next((m.weight for n, m in modules.items() if pattern.match(n)), None)
    if weight is None:
        return None, []
    tied = [n for n, m in modules.items() if getattr(m, "weight", None) is weight and not pattern.match(n)]
    return cast(nn.Parameter, weight), tied


def _check_coverage(model: nn.Module, rule_set: RuleSet, rules: dict[str, Rule], tp_size: int) -> None:
    """Every required rule matched a module, and a TP conversion split at least one linear layer."""
    matched = {rule.pattern for rule in rules.values()}
    missing = [r.pattern for r in rule_set.rules if not r.optional and r.pattern not in matched]
    if missing:
        raise UnsupportedModelError(
            f"{type(model).__name__}: the {rule_set.name} rules {missing} match no module; this model needs its own "
            f"rule file under mtk/rules/ (docs/architectures.md, 'Adding an architecture')"
        )
    if tp_size > 1 and not any(rule.style.splits_linear for rule in rules.values()):
        raise UnsupportedModelError(f"{type(model).__name__}: the {rule_set.name} rules split no linear layer here")


def _hook_shared_inputs(modules: dict[str, nn.Module], shared: dict[str, SharedInput], ctx: BuildContext) -> None:
    """Copy each shared input into the TP region once, before the module whose columns read it."""
    for name, spec in shared.items():
        argument = spec.argument or next(iter(inspect.signature(modules[name].forward).parameters))
        hook = CopyInputToTP(argument, ctx.parallel.tp_group, ctx.sequence_parallel)
        modules[name].register_forward_pre_hook(hook, with_kwargs=True)


def _fix_attributes(model: nn.Module, rule_set: RuleSet, sizes: RuleContext) -> None:
    """Per-rank values for HF's own modules' attributes (heads per rank)."""
    for name, module in model.named_modules():
        for fix in rule_set.attr_fixes:
            if fix.matches(name) and hasattr(module, fix.attr):
                setattr(module, fix.attr, fix.value(sizes))


def _install_vocab_parallel_loss(
    model: nn.Module,
    converted: dict[str, nn.Module],
    rules: dict[str, Rule],
    logits: str,
    loss_chunk_tokens: int | None,
) -> None:
    """The model's loss becomes the vocab-parallel cross-entropy of its (ungathered) LM head's split logits, chunked
    where the model hands the head's logits to the loss unchanged."""
    heads = [cast(ColumnParallelLinear, m) for n, m in converted.items() if rules[n].style is LM_HEAD]
    head = next((m for m in heads if not m.gather_output), None)
    if head is None:
        return
    if loss_chunk_tokens is not None and loss_chunk_tokens < 0:
        raise ConfigError(f"loss_chunk_tokens must be 0 (off) or a number of tokens, got {loss_chunk_tokens}")
    name = type(model).__name__
    transform = logits_transform(getattr(model, "config", None))
    if transform is not None and loss_chunk_tokens:
        raise ConfigError(
            f"{name} changes its logits after the LM head ({transform}), which mtk's chunked loss does not apply; "
            "leave loss_chunk_tokens unset or 0 for this model"
        )
    defer = loss_chunk_tokens != 0 and transform is None
    cast(Any, model).loss_function = VocabParallelCausalLMLoss(head, loss_chunk_tokens, name)
    attach_logits_hook(model, LogitsGatherHook(head, logits, defer=defer))


def _take_over_fused_head(model: nn.Module) -> None:
    """TRL's fused LM head, if it was added before conversion, becomes mtk's vocab-parallel one; one added after
    is refused when called (:mod:`mtk.rules.fused_head`)."""
    get_head = getattr(model, "get_output_embeddings", None)
    if get_head is not None and needs_vocab_parallel_head(get_head()):
        model.register_forward_pre_hook(FusedHeadGuard(), with_kwargs=True)
        replace_trl_fused_head(model)


def _retie_embeddings(
    model: nn.Module,
    converted: dict[str, nn.Module],
    rules: dict[str, Rule],
    old_embedding: nn.Parameter | None,
    tied_heads: list[str],
) -> None:
    """Output embeddings that shared the input embedding's weight share its shard after conversion.

    Ties are found by parameter identity before conversion (what HF's ``tie_weights`` produced), so
    an untied model stays untied whatever its config says.
    """
    untied = [n for n in tied_heads if n not in converted]
    if untied:
        raise UnsupportedModelError(f"{untied} are tied to the input embedding but no rule splits them")
    if old_embedding is None:
        return
    for name, param in model.named_parameters(remove_duplicate=False):
        if param is old_embedding:
            raise UnsupportedModelError(
                f"{name} is tied to the input embedding but no rule splits it; add an lm_head rule for it"
            )
    embedding = next((m for n, m in converted.items() if rules[n].style is VOCAB), None)
    for name in tied_heads:
        head = converted[name]
        if embedding is None or cast(torch.Tensor, head.weight).shape != cast(torch.Tensor, embedding.weight).shape:
            raise UnsupportedModelError(f"{name} cannot stay tied to the vocab-parallel embedding: shards differ")
        head.weight = embedding.weight
