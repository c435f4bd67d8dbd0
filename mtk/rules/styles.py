"""Parallel styles: what a rule turns the modules it names into, one class per style.

A :class:`~mtk.rules.base.Rule` pairs a module-name pattern with a style object (``COLUMN``, ``ROW``, ...);
:func:`mtk.rules.apply.parallelize_with` asks each matched module's style to :meth:`ParallelStyle.build` its
replacement, as torch's ``ParallelStyle`` and torchtitan's plans do. A style also answers the facts the
conversion asks of it (whether it splits a linear layer).

Adding a style (context-parallel attention, expert-parallel experts) is one subclass with a ``name`` and a
``build``, registered with :func:`register_style`; rule files then name its instance (or its name string).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from mtk.errors import UnsupportedModelError
from mtk.parallel.embedding import VocabParallelEmbedding
from mtk.parallel.expert_tokens import split_tokens_over_tp
from mtk.parallel.experts import split_experts
from mtk.parallel.grads import share_params_across_tp
from mtk.parallel.layers import ColumnParallelLinear, KVReplicatedColumnLinear, RowParallelLinear
from mtk.parallel.norms import SplitRMSNorm
from mtk.parallel.vocab_head import VocabParallelHead

if TYPE_CHECKING:
    from mtk.rules.apply import BuildContext
    from mtk.rules.base import Rule

__all__ = [
    "COLUMN",
    "EXPERTS",
    "KV_COLUMN",
    "LM_HEAD",
    "ROW",
    "SPLIT_NORM",
    "STYLES",
    "TP_SHARED",
    "VOCAB",
    "ParallelStyle",
    "register_style",
]


class ParallelStyle(abc.ABC):
    """How one module becomes tensor-parallel.

    Attributes:
        name: the style's name in rule files, messages and the registry.
        splits_linear: whether it splits a linear layer's weights (a TP conversion must split at least one).
    """

    name: ClassVar[str]
    splits_linear: ClassVar[bool] = False

    @abc.abstractmethod
    def build(self, module: nn.Module, name: str, rule: Rule, ctx: BuildContext) -> nn.Module | None:
        """The replacement for ``module`` on the meta device (its shards are copied in afterwards), or ``None``
        when the module is kept and changed in place."""

    def __repr__(self) -> str:
        return self.name

    def __reduce__(self) -> str | tuple[Any, ...]:
        """A copied or unpickled registered style is the registered instance (rules compare styles by identity)."""
        return (_registered, (self.name,)) if STYLES.get(self.name) is self else super().__reduce__()


STYLES: dict[str, ParallelStyle] = {}


def _registered(name: str) -> ParallelStyle:
    return STYLES[name]


def register_style(style: ParallelStyle) -> ParallelStyle:
    """Make ``style`` known by its name (to rules written with the name, and to messages listing styles)."""
    if style.name in STYLES:
        raise ValueError(f"a parallel style named {style.name!r} is already registered")
    STYLES[style.name] = style
    return style


def _meta(module: nn.Module) -> dict[str, Any]:
    """Constructor arguments for a replacement on the meta device with ``module``'s dtype."""
    return {"device": "meta", "dtype": cast(torch.Tensor, module.weight).dtype}


def _linear_dims(module: nn.Module, name: str) -> tuple[int, int, bool, bool]:
    """(in_features, out_features, has_bias, transposed) of an nn.Linear or HF Conv1D."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, module.bias is not None, False
    if type(module).__name__ == "Conv1D":  # transformers.pytorch_utils.Conv1D: weight [in, out]
        n_in, n_out = cast(torch.Tensor, module.weight).shape
        return n_in, n_out, module.bias is not None, True
    raise UnsupportedModelError(f"{name} is a {type(module).__name__}; a linear rule needs nn.Linear or Conv1D")


def _linear_args(module: nn.Module, name: str, ctx: BuildContext) -> tuple[tuple[int, int, bool], dict[str, Any]]:
    """``(in_features, out_features, bias)`` and the keywords every parallel linear replacing ``module`` takes."""
    n_in, n_out, bias, transposed = _linear_dims(module, name)
    return (n_in, n_out, bias), {"tp_group": ctx.parallel.tp_group, "transposed": transposed, **_meta(module)}


class ColumnStyle(ParallelStyle):
    """``Y = X A^T``: A's output rows split across ranks, each part of a fused projection (``rule.parts``) on its
    own. Exact: every rank computes whole output features, a slice of Y; backward all-reduces dL/dX (once per
    shared input when the module sits in one of the rules' ``shared_inputs``)."""

    name = "column"
    splits_linear = True

    def build(self, module: nn.Module, name: str, rule: Rule, ctx: BuildContext) -> nn.Module | None:
        copy_input = ctx.column_copies_input(name)
        args, kwargs = _linear_args(module, name, ctx)
        parts = rule.parts(ctx.sizes.config) if rule.parts else None
        return ColumnParallelLinear(
            *args, output_sizes=parts, gather_output=rule.gather_output, copy_input=copy_input, **kwargs
        )


class KVColumnStyle(ColumnStyle):
    """A k or v projection: split by kv heads like a column when tp divides them; when tp is a multiple of them,
    each rank holds one kv head whole (its copies' weight gradients summed over the ranks sharing it). Exact
    either way: each rank's query heads see the kv head they attend to in the full model."""

    name = "kv_column"

    def build(self, module: nn.Module, name: str, rule: Rule, ctx: BuildContext) -> nn.Module | None:
        if ctx.sizes.kv_copies == 1:
            return super().build(module, name, rule, ctx)
        copy_input = ctx.column_copies_input(name)
        (n_in, _, bias), kwargs = _linear_args(module, name, ctx)
        kwargs.update(kv_group=ctx.parallel.tp_subgroup(ctx.sizes.kv_copies), copy_input=copy_input)
        return KVReplicatedColumnLinear(n_in, ctx.sizes.counts.num_kv_heads, ctx.sizes.head_dim, bias, **kwargs)


class RowStyle(ParallelStyle):
    """``Y = X A^T + b``: A's input columns split, so ``X A^T = sum_r X_r A_r^T`` and one all-reduce (a
    reduce-scatter under sequence parallelism) sums the ranks' partial products exactly; the bias is added once,
    after it. ``rule.split_input``: the input arrives whole (after a gathered column) and is cut first."""

    name = "row"
    splits_linear = True

    def build(self, module: nn.Module, name: str, rule: Rule, ctx: BuildContext) -> nn.Module | None:
        args, kwargs = _linear_args(module, name, ctx)
        return RowParallelLinear(
            *args, input_is_parallel=not rule.split_input, sequence_parallel=ctx.sequence_parallel, **kwargs
        )


def _embed_scale(module: nn.Module) -> float | None:
    """The factor a scaled embedding (Gemma's, BART's: an ``nn.Embedding`` subclass) multiplies lookups by."""
    scale = getattr(module, "scalar_embed_scale", None)  # Gemma keeps a float beside the (possibly meta) buffer
    scale = getattr(module, "embed_scale", None) if scale is None else scale
    if scale is None:
        return None
    if torch.is_tensor(scale) and scale.device.type == "meta":
        raise UnsupportedModelError(f"{type(module).__name__}: its embed_scale is on the meta device; load it first")
    return float(scale.item()) if torch.is_tensor(scale) else float(scale)


class VocabStyle(ParallelStyle):
    """The input embedding split along the vocabulary (padded to a multiple of tp): each rank looks up the tokens
    it owns and zeroes the rest, so the all-reduce of the lookups is exactly the full lookup."""

    name = "vocab"

    def build(self, module: nn.Module, name: str, rule: Rule, ctx: BuildContext) -> nn.Module | None:
        if not isinstance(module, nn.Embedding):
            raise UnsupportedModelError(f"{name} is a {type(module).__name__}; the vocab rule needs nn.Embedding")
        return VocabParallelEmbedding(
            module.num_embeddings,
            module.embedding_dim,
            module.padding_idx,
            tp_group=ctx.parallel.tp_group,
            pad_to_multiple_of=ctx.pad_vocab_to_multiple_of,
            embed_scale=_embed_scale(module),
            **_meta(module),
        )


class LMHeadStyle(ParallelStyle):
    """The output projection split along the (padded) vocabulary, a column whose logits stay split: mtk's
    vocab-parallel loss reduces max, sum of exp and target logit over TP, exactly the full cross-entropy. Kept
    tied to the vocab-parallel embedding when the model ties them; in training its product is deferred to the
    chunked loss (:class:`~mtk.parallel.vocab_head.VocabParallelHead`)."""

    name = "lm_head"

    def build(self, module: nn.Module, name: str, rule: Rule, ctx: BuildContext) -> nn.Module | None:
        args, kwargs = _linear_args(module, name, ctx)
        pad = ctx.pad_vocab_to_multiple_of
        return VocabParallelHead(*args, pad_to_multiple_of=pad, gather_output=rule.gather_output, **kwargs)


class TPSharedStyle(ParallelStyle):
    """Replicated parameters applied to split activations (per-head q/k norms): each rank's gradient covers only
    its heads, so the gradients are summed over TP, which makes every replica's update the full model's."""

    name = "tp_shared"

    def build(self, module: nn.Module, name: str, rule: Rule, ctx: BuildContext) -> nn.Module | None:
        share_params_across_tp(module, [n for n, _ in module.named_parameters(recurse=False)], ctx.parallel.tp_group)
        return None


class ExpertsStyle(ParallelStyle):
    """MoE experts stored as 3D tensors. At the experts' TP size equal to TP (the default), each expert's MLP is
    split in place as a column/row pair over its intermediate width: the routed sum of per-expert partial outputs
    is all-reduced once, exactly (:mod:`mtk.parallel.experts`). At the experts' TP size 1 the experts stay whole
    and each TP rank runs them on its share of the tokens (:mod:`mtk.parallel.expert_tokens`)."""

    name = "experts"
    splits_linear = True

    def build(self, module: nn.Module, name: str, rule: Rule, ctx: BuildContext) -> nn.Module | None:
        if ctx.parallel.etp_size == 1 and ctx.parallel.tp_size > 1:
            split_tokens_over_tp(module, ctx.parallel.tp_group)
        else:
            split_experts(module, ctx.parallel.tp_group, getattr(ctx.sizes.config, "moe_intermediate_size", None))
        return None


class SplitNormStyle(ParallelStyle):
    """An RMSNorm over a split projection (OLMo2's q/k norms): each rank keeps its slice of the weight and the sum
    of squares is all-reduced, so every rank divides by the full projection's norm, exactly."""

    name = "split_norm"

    def build(self, module: nn.Module, name: str, rule: Rule, ctx: BuildContext) -> nn.Module | None:
        width = cast(torch.Tensor, module.weight).shape[0]
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
        return SplitRMSNorm(width, eps, tp_group=ctx.parallel.tp_group, **_meta(module))


COLUMN = register_style(ColumnStyle())  # split output features (q/k/v, gate/up, fused parts with ``parts``)
KV_COLUMN = register_style(KVColumnStyle())  # k/v: split by kv heads, or one kv head per rank when tp > n_kv
ROW = register_style(RowStyle())  # split input features (o_proj, down_proj); all-reduce after
VOCAB = register_style(VocabStyle())  # vocabulary-parallel input embedding
LM_HEAD = register_style(LMHeadStyle())  # vocabulary-parallel output projection (tied to VOCAB when tied)
TP_SHARED = register_style(TPSharedStyle())  # replicated params on split heads: grads summed over TP
EXPERTS = register_style(ExpertsStyle())  # MoE experts as 3D tensors: each expert's MLP split in place
SPLIT_NORM = register_style(SplitNormStyle())  # RMSNorm over a split projection: sum of squares all-reduced
