"""Context parallelism for HF models: the sequence split over a CP group, attention through transformers' own
attention interface.

A batch is cut along the sequence before the model sees it (:func:`split_for_context`): with ``2·cp`` equal chunks,
CP rank ``r`` takes chunks ``r`` and ``2·cp−1−r`` (the load-balanced causal split: every rank holds early and late
tokens, so each does the same attention work). What cannot be recovered after the cut is computed first, on the
whole row: the labels shifted by one (each token's next one may sit on another rank), each token's index in the
row, its document (packed rows: a new document wherever ``position_ids`` does not go up by one, transformers' own
rule) and whether it is padding. The position ids themselves are cut like the tokens, so rotary embeddings see
each token's true position.

Every decoder layer then runs as usual on the rank's tokens (norms, MLPs, projections are per token) except
attention, which is registered with transformers' ``AttentionInterface`` as :data:`ATTENTION` and runs over the CP
group as :func:`~mtk.parallel.ring_attention.ring_attention` (``comm="p2p"``, the default) or
:func:`~mtk.parallel.a2a_attention.all_to_all_attention` (``"a2a"``, which needs the heads to split over CP):
a query sees a key when the key's row index is not larger, the document is the same and the key is not padding:
the unsplit model's causal, packed, padded mask, whatever the split. The split's metadata reaches it the way
transformers passes per-call attention arguments, as a keyword (:data:`KEYWORD`) of the model's forward that flows
to every attention call; no mask is built (:data:`ATTENTION`'s mask function returns none).

The loss is the HF model's, token-weighted over the CP group like over data parallelism: each rank sums its
tokens' losses and divides by the labelled tokens of the whole row (``num_items_in_batch``), so the CP ranks' shares
add up to the row's mean. A model made context-parallel by :func:`attach_context_parallel` then behaves like ``cp``
data-parallel replicas given the same batch (Megatron-Core's convention, which scales each CP rank's loss by ``cp``):
every CP rank returns the whole batch's loss, and backpropagates ``cp`` times its share, so the gradients averaged
over the DP x CP replica group (DDP, the distributed optimizer) are the unsplit model's and every metric reduced
over DP is unchanged.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, create_masks_for_generate

from mtk.config import CP_COMM_TYPES
from mtk.data.formats import IGNORE_INDEX
from mtk.errors import ConfigError
from mtk.models import is_causal_lm_class
from mtk.parallel.a2a_attention import all_to_all_attention
from mtk.parallel.comm import Group, all_reduce, gather_from_sequence, group_rank, group_size
from mtk.parallel.recompute import never_saved
from mtk.parallel.ring_attention import ring_attention
from mtk.parallel.router_loss import set_active, whole_router_loss
from mtk.parallel.sequence_padding import (
    PER_POSITION,
    carries_cache,
    keep_logits,
    named_arguments,
    pad_batch,
    pop_logits_to_keep,
)
from mtk.parallel.split_call_cache import SplitCallCache, refuse_split_call_cache, with_cache_stand_in

__all__ = [
    "ATTENTION",
    "KEYWORD",
    "ContextShard",
    "ContextSplit",
    "SplitCallCache",
    "attach_context_parallel",
    "balanced_indices",
    "context_parallel_of",
    "split_for_context",
    "use_context_attention",
    "whole_rows",
]

ATTENTION = "mtk_context"  # the attention implementation's name in transformers' registry
KEYWORD = "mtk_context"  # the forward keyword carrying a ContextShard to every attention call
_PER_TOKEN = ("logits", "hidden_states")  # per-position outputs of every token; the others are label-aligned
_ATTACHED = "_mtk_context_parallel"  # the ContextSplit of a model attach_context_parallel converted
SPLIT_INPUTS = ("input_ids", "labels", "shift_labels", "attention_mask", "position_ids")  # [b, S] each, cut
COMM_TYPES = CP_COMM_TYPES


@dataclass
class ContextShard:
    """This rank's tokens of a split batch, as attention needs them: ``[b, s]`` each."""

    group: Group
    positions: torch.Tensor  # each token's index in the whole row
    documents: torch.Tensor  # its document (packed rows), any integers
    valid: torch.Tensor  # False for padding
    comm: str = "p2p"  # Megatron's cp_comm_type: "p2p" (ring attention) or "a2a" (all-to-all, Ulysses)
    row_length: int | None = None  # the caller's row length, before padding for the split
    caller_shifted: bool = False  # the caller passed shift_labels: label-aligned outputs keep every position
    average: bool = True  # the CP ranks' gradients are averaged (else summed: ContextSplit.average)
    logits_to_keep: int | torch.Tensor = 0  # the caller's: applied to the whole rows' logits (0: every position)
    as_tuple: bool = False  # the caller asked for return_dict=False: the whole outputs as a tuple
    cache_stand_in: bool = False  # one process would return a cache: a SplitCallCache takes its place

    def __len__(self) -> int:
        """Rows, as a ``[b, ...]`` tensor's ``len``: a pipeline cuts micro-batches of shards as of tensors."""
        return self.positions.shape[0]

    def tensor_split(self, count: int) -> list[ContextShard]:
        """``count`` shards of consecutive rows (``torch.tensor_split``'s split: sizes that differ by at most one)."""
        pieces = zip(*(t.tensor_split(count) for t in (self.positions, self.documents, self.valid)))
        return [dataclasses.replace(self, positions=p, documents=d, valid=v) for p, d, v in pieces]


def balanced_indices(seq: int, rank: int, size: int, device: torch.device | None = None) -> torch.Tensor:
    """The row indices CP rank ``rank`` of ``size`` holds: chunks ``rank`` and ``2·size−1−rank`` of ``2·size``."""
    if seq % (2 * size):
        raise ConfigError(
            f"a sequence of {seq} tokens does not split into 2 x {size} equal chunks for context parallelism; "
            f"pad rows to a multiple of {2 * size}"
        )
    chunk = seq // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([first, last])  # [s / size]


def documents_of(position_ids: torch.Tensor) -> torch.Tensor:
    """``[b, S]`` document ids: a new document wherever the position does not go up by one (transformers' rule for
    packed rows, ``find_packed_sequence_indices``)."""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)  # [b, S]
    return (step != 1).cumsum(-1)


def _documents(position_ids: torch.Tensor, packed: bool) -> torch.Tensor:
    """``[b, S]`` document ids as transformers decides them: restarting positions separate packed documents only
    where the caller gave no attention mask (``_preprocess_mask_arguments``); with one, a row is one causal
    sequence."""
    return documents_of(position_ids) if packed else torch.zeros_like(position_ids)


def split_for_context(
    batch: dict[str, torch.Tensor], group: Group, comm: str = "p2p", *, packed: bool | None = None
) -> tuple[dict[str, Any], torch.Tensor]:
    """This CP rank's part of ``batch`` (``input_ids``, ``labels`` or ``shift_labels`` (already shifted: position
    ``t`` labelled with what follows it), optional ``attention_mask``/``position_ids``,
    each ``[b, S]``) and the labelled tokens of the whole batch, to pass as ``num_items_in_batch``.

    Returns the model's keyword arguments: the rank's ``input_ids`` and ``position_ids``, ``labels`` and
    ``shift_labels`` already shifted on the whole row, ``use_cache=False`` and :data:`KEYWORD` (the
    :class:`ContextShard`). ``packed``: whether restarting position ids separate documents, as transformers
    decides for the caller's batch (``None``: where ``batch`` has no attention mask; a caller that added one for
    its own padding says what its caller gave).
    """
    if comm not in COMM_TYPES:
        raise ConfigError(f"cp_comm_type {comm!r} is unknown; use one of {COMM_TYPES}")
    input_ids = batch["input_ids"]  # [b, S]
    b, seq = input_ids.shape
    device = input_ids.device
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(seq, device=device)
    position_ids = position_ids.expand(b, seq)  # ([1, S] or [S] for every row, as transformers broadcasts them)
    mask = batch.get("attention_mask")
    valid = torch.ones(b, seq, dtype=torch.bool, device=device) if mask is None else mask.bool()
    labels = batch.get("labels")
    shifted = batch.get("shift_labels")
    _check_token_labels(input_ids, labels)
    if shifted is None and labels is not None:
        shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]  # [b, S]: token t predicts t + 1
    mine = balanced_indices(seq, group_rank(group), group_size(group), device)
    shard = ContextShard(
        group=group,
        positions=torch.arange(seq, device=device).expand(b, seq)[:, mine],
        documents=_documents(position_ids, mask is None if packed is None else packed)[:, mine],
        valid=valid[:, mine],
        comm=comm,
    )
    local: dict[str, Any] = {
        "input_ids": input_ids[:, mine],
        "position_ids": position_ids[:, mine],
        "use_cache": False,  # a cache of this rank's keys is of no use to anyone
        KEYWORD: shard,
    }
    count = torch.zeros((), dtype=torch.long, device=device)
    if shifted is not None:
        local["labels"] = local["shift_labels"] = shifted[:, mine]
        count = (shifted != IGNORE_INDEX).sum()
    return local, count


def _check_token_labels(input_ids: torch.Tensor, labels: torch.Tensor | None) -> None:
    if labels is not None and labels.shape != input_ids.shape:
        raise ConfigError(
            f"context parallelism cuts token labels shaped as input_ids {tuple(input_ids.shape)}; these are "
            f"{tuple(labels.shape)} (one per row: a sequence-level task): use cp = 1"
        )


def _context_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [b, h, s, d]``, ``key``/``value`` ``[b, h_kv, s, d]`` ->
    ``([b, s, h, d], None)``."""
    shard = kwargs.get(KEYWORD)
    name = type(module).__name__
    if not isinstance(shard, ContextShard):
        raise ConfigError(
            f"{name} runs context-parallel attention but the call carries no split batch; cut it with "
            "mtk.parallel.context.split_for_context and pass what it returns"
        )
    if getattr(module, "is_causal", True) is False:
        raise ConfigError(f"{name} attends both ways; mtk's context-parallel attention is causal (decoders)")
    for unsupported in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(unsupported) is not None or getattr(module, unsupported, None) is not None:
            raise ConfigError(f"{name} uses {unsupported}, which mtk's context-parallel attention does not apply")
    if dropout and module.training:
        raise ConfigError(f"{name} has attention dropout {dropout}; context parallelism computes attention without it")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    attend = all_to_all_attention if shard.comm == "a2a" else ring_attention
    with never_saved():  # under selective recompute the attention reruns (Megatron's "core attention" recompute)
        out = attend(query, key, value, shard.positions, shard.documents, shard.valid, shard.group, scaling=scaling)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask function of :data:`ATTENTION`: none is built (attention masks from the split's metadata)."""
    return None


AttentionInterface.register(ATTENTION, _context_attention)
AttentionMaskInterface.register(ATTENTION, _no_mask)


def use_context_attention(model: Any) -> None:
    """Run ``model``'s attention context-parallel (transformers' ``set_attn_implementation``)."""
    model.set_attn_implementation(ATTENTION)


@dataclass(frozen=True)
class ContextSplit:
    """How a context-parallel model cuts whole batches: over ``group`` by ``comm``, rows first padded at the end to
    a multiple of ``multiple`` positions (unlabelled and masked: nothing real changes, :func:`pad_batch`)."""

    group: Group
    comm: str
    multiple: int
    average: bool = True  # gradients averaged over the CP ranks (DDP, FSDP2); False: summed (DeepSpeed's Ulysses)

    def __call__(
        self, tensors: dict[str, torch.Tensor], num_items: Any = None, row_length: int | None = None
    ) -> dict[str, Any]:
        """This rank's model arguments for the whole batch ``tensors`` (``input_ids``, ``labels`` or
        ``shift_labels``, optional ``attention_mask``/``position_ids``, ``[b, S]``).

        ``num_items_in_batch`` is ``num_items`` (the caller's count, over whole rows) or the batch's labelled
        tokens, divided by ``cp`` where the CP ranks' gradients are averaged: the rank's loss is ``cp`` times its
        share (see the module docstring); where they are summed, its share.
        ``row_length``: the length per-position outputs are gathered back to (default: the caller's)."""
        length = tensors["input_ids"].shape[1]
        _check_token_labels(tensors["input_ids"], tensors.get("labels"))  # (the caller's shapes, before the padding)
        packed = tensors.get("attention_mask") is None  # (the caller's: the mask below marks only the padding)
        if "attention_mask" not in tensors and length % self.multiple:  # (the appended positions marked invalid:
            # the router's load-balancing loss counts the valid tokens, and the unsplit model had no pads)
            tensors = {**tensors, "attention_mask": torch.ones_like(tensors["input_ids"])}
        padded, extra = pad_batch(tensors, self.multiple, reason="context parallelism")
        if extra:  # the appended positions repeat the row's last (a table of learned positions, GPT-2's, ends at
            # the model's length: counting on went past it); they are invalid keys and no real token sees them
            given = tensors.get("position_ids")
            rows = tensors["input_ids"].shape[0]
            real = given.expand(rows, -1) if given is not None else torch.arange(length).expand(rows, -1)  # [b, S]
            real = real.to(tensors["input_ids"].device)
            padded["position_ids"] = torch.cat([real, real[:, -1:].expand(-1, extra)], dim=1)  # [b, S + extra]
        local, count = split_for_context(padded, self.group, self.comm, packed=packed)
        shard = local[KEYWORD]
        shard.row_length = length if row_length is None else row_length
        shard.caller_shifted = "shift_labels" in tensors
        shard.average = self.average
        if "labels" in local:
            count = count if num_items is None else num_items
            local["num_items_in_batch"] = count / group_size(self.group) if self.average else count
        return local


class _SplitInputs:
    """Forward pre-hook: the whole batch a caller passes becomes this CP rank's part (:class:`ContextSplit`).

    A call with a KV cache (``generate``'s, which passes one from its first step: a cut prompt would
    leave each rank's cache with its own tokens only) runs whole on every rank with the model's own attention
    (``unsplit``), masks included, for that call only (:func:`_context_attention_again`)."""

    def __init__(self, split: ContextSplit, unsplit: str, signature: inspect.Signature) -> None:
        self.split = split
        self.unsplit = unsplit
        self.signature = signature

    def __call__(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        if args:  # (model(ids, mask): every positional argument, by name)
            kwargs = named_arguments(self.signature, args, kwargs)
        # a call with a cache, or one without gradients that asks for one (a hand-written decoding loop's prefill)
        asked_cache = kwargs.get("use_cache")
        training = module.training and torch.is_grad_enabled()
        decoding = KEYWORD not in kwargs and (carries_cache(kwargs) or (asked_cache is True and not training))
        _attend_with(module, self.unsplit if decoding else ATTENTION)
        if decoding:
            refuse_split_call_cache(module, kwargs)
            if training:  # (whole on every rank: gradients cp times the share where the CP ranks' are summed)
                raise ConfigError(
                    f"{type(module).__name__} is context-parallel: a training call that carries a KV cache (a "
                    "prefix's keys, PEFT's prefix tuning) cannot be split over the CP ranks; use cp = 1"
                )
            if torch.is_grad_enabled() and not self.split.average:  # (DeepSpeed sums the CP ranks' gradients)
                raise ConfigError(
                    f"{type(module).__name__} is context-parallel under DeepSpeed, which sums the CP ranks' "
                    "gradients: a call that runs whole on every CP rank (eval mode with a KV cache) with gradients on "
                    "would pass back cp copies of its gradient; run it under torch.no_grad() (decoding), or use cp = 1"
                )
            return (), kwargs
        if KEYWORD in kwargs:
            set_active(kwargs[KEYWORD])
            return (), kwargs  # split already (a pipeline splits before it cuts micro-batches)
        if kwargs.get("output_attentions", getattr(module.config, "output_attentions", False)):
            raise ConfigError(
                f"{type(module).__name__} is context-parallel: its attention over the split rows computes no "
                "attention weights to return (output_attentions); leave it unset, or use cp = 1"
            )
        if kwargs.get("input_ids") is None:
            raise ConfigError(
                f"{type(module).__name__} is context-parallel and splits input_ids along the sequence; this call "
                "passes none (inputs_embeds are not split): pass input_ids"
            )
        tensors: dict[str, torch.Tensor] = {k: kwargs.pop(k) for k in SPLIT_INPUTS if kwargs.get(k) is not None}
        for k in SPLIT_INPUTS:
            kwargs.pop(k, None)
        kept = pop_logits_to_keep(kwargs)  # (of the whole rows: HF's would keep each rank's last positions)
        asked = kwargs.pop("return_dict", None)  # (gathered by name: a ModelOutput, a tuple after)
        as_tuple = (getattr(module.config, "return_dict", True) if asked is None else asked) is False
        kwargs.pop("use_cache", None)  # (the split's own: False)
        local = self.split(tensors, kwargs.pop("num_items_in_batch", None))
        local["return_dict"] = True
        local[KEYWORD].logits_to_keep = kept
        local[KEYWORD].as_tuple = as_tuple
        # where one process would return a cache: one that holds no keys, refused if a call is given it
        returns_cache = getattr(module.config, "use_cache", False) if asked_cache is None else asked_cache
        local[KEYWORD].cache_stand_in = bool(returns_cache)
        set_active(local[KEYWORD])  # the router's load-balancing loss sums over the group (mtk.parallel.router_loss)
        return (), {**kwargs, **local}


def _attend_with(model: Any, implementation: str) -> None:
    """``model``'s attention implementation for this call (set only where it changes: a check per call)."""
    if model.config._attn_implementation != implementation:
        model.set_attn_implementation(implementation)


class _OwnAttentionMasks:
    """A context-parallel model's ``create_masks_for_generate`` (generate looks it up on the model). A compiled
    cache's masks are built in ``prepare_inputs_for_generation``, before the decoding call and outside it, by the
    mask function of the model's attention implementation: :data:`ATTENTION`'s builds none (a split call attends by
    its shard), which left a left-padded batch unmasked. They are built as the model's own attention would build
    them, which the decoding call then runs with."""

    def __init__(self, model: Any, unsplit: str) -> None:
        self.model = model
        self.unsplit = unsplit
        self.build = getattr(model, "create_masks_for_generate", create_masks_for_generate)  # (a model's own first)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _attend_with(self.model, self.unsplit)
        try:
            return self.build(*args, **kwargs)
        finally:
            _attend_with(self.model, ATTENTION)


def _context_attention_again(module: Any, args: tuple, output: Any) -> None:
    """Forward hook (run even when the call raised): a decoding call's own attention ends with it, so that nothing
    later runs the model's layers unsplit-style on a split batch (a recomputed layer in backward, a call to a
    submodule)."""
    _attend_with(module, ATTENTION)


def _whole_outputs(module: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
    """Forward hook: what the call returns is the whole batch's, on every CP rank.

    The loss is the whole batch's (the mean of the CP ranks' values, or their sum where each is its share), with
    this rank's own gradient (``cp`` times its share, or its share). Every per-position output (logits, hidden
    states, TRL's fused-head fields) is gathered over the group into whole rows, in row order, without the split's
    padding; its gradient goes back to the rank that computed each position (summed over the ranks that used it,
    which the average over the replicas then divides; where the replicas sum, this rank's own). The chunked loss's
    logits stand-in holds nothing and stays as it is."""
    shard = kwargs.get(KEYWORD)
    set_active(None)
    if not isinstance(shard, ContextShard):
        return output
    loss = getattr(output, "loss", None)
    if loss is not None:
        whole = all_reduce(loss.detach().clone(), shard.group) / (group_size(shard.group) if shard.average else 1)
        output.loss = whole + (loss - loss.detach())  # (its value exactly the all-reduced one on every CP rank)
    local = shard.positions.shape[1]
    length = shard.row_length or local * group_size(shard.group)
    for key in PER_POSITION:
        value = getattr(output, key, None)
        # a fused head's label-aligned fields: one position fewer when the call shifted its labels itself
        keep = length if key in _PER_TOKEN or shard.caller_shifted else length - 1
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == local and any(value.stride()):
            output[key] = whole_rows(value, shard)[:, :keep]
        elif isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value):
            # (a layer output_hidden_states=[i] did not select is None)
            output[key] = tuple(whole_rows(v, shard) if isinstance(v, torch.Tensor) else v for v in value)
    routers = getattr(output, "router_logits", None)
    if isinstance(routers, tuple) and routers and all(isinstance(r, torch.Tensor) for r in routers):
        output["router_logits"] = tuple(_whole_router_logits(r, shard) for r in routers)
    output = keep_logits(output, shard.logits_to_keep)
    if shard.cache_stand_in:
        output = with_cache_stand_in(output)
    return output.to_tuple() if shard.as_tuple else output


def _whole_router_logits(local: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """An MoE layer's router logits of this rank's tokens (``[b * s/cp, E]``, flattened row by row as HF's MoE
    blocks return them, or ``[b, s/cp, E]``) -> the whole rows' (``[b * S, E]`` / ``[b, S, E]``)."""
    rows, local_length = shard.positions.shape
    if local.dim() == 3 and tuple(local.shape[:2]) == (rows, local_length):
        return whole_rows(local, shard)
    if local.dim() != 2 or local.shape[0] != rows * local_length:
        return local  # (not per token of this call)
    whole = whole_rows(local.reshape(rows, local_length, -1), shard)  # [b, S, E]
    return whole.reshape(-1, whole.shape[-1])  # [b * S, E]


def whole_rows(local: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """``[b, s/cp, ...]`` per-position values of this rank -> ``[b, S, ...]`` of the whole rows (collective; the
    gradient of each position returns to the rank that holds it)."""
    size = group_size(shard.group)
    # [b, S, ...], rank r's positions at r * s/cp; backward: the gradients of this rank's positions, summed over the
    # ranks (each computed them) where the replicas average, this rank's own where they sum
    gathered = gather_from_sequence(local, shard.group, dim=1, partial_grad=shard.average)
    seq = gathered.shape[1]
    order = torch.cat([balanced_indices(seq, r, size, local.device) for r in range(size)])  # [S]: row index of each
    return gathered.index_select(1, torch.argsort(order)[: shard.row_length or seq])  # [b, S, ...] in row order


def attach_context_parallel(
    model: Any, group: Group, comm: str = "p2p", sequence_split: int = 1, average: bool = True
) -> None:
    """Make ``model`` context-parallel over ``group``: attention as :data:`ATTENTION`, and every call's whole batch
    split to this rank's tokens first. Each CP rank then returns the whole batch's loss and backpropagates ``cp``
    times its share: average the gradients over the CP group (with DP: over the DP x CP replica group), as over
    data-parallel replicas. ``sequence_split``: how many ways each rank's tokens are cut again (the TP size under
    sequence parallelism), so rows are padded to a multiple of ``2·cp`` and of ``cp·sequence_split``. ``average``
    False: the engine sums the CP ranks' gradients (DeepSpeed's sequence-data-parallel reduction divides by DP
    only), so each rank backpropagates its share. A second call with the same group changes nothing."""
    if comm not in COMM_TYPES:
        raise ConfigError(f"cp_comm_type {comm!r} is unknown; use one of {COMM_TYPES}")
    both_ways = next((n for n, m in model.named_modules() if getattr(m, "is_causal", None) is False), None)
    if both_ways is not None:  # (an encoder: BERT's self-attention)
        kind = type(model.get_submodule(both_ways)).__name__
        raise ConfigError(
            f"{type(model).__name__}: {both_ways} ({kind}) attends both ways; mtk's context-parallel attention is "
            "causal (decoders): use cp = 1 for this model"
        )
    if not is_causal_lm_class(type(model).__name__):  # (a head over whole rows)
        raise ConfigError(
            f"{type(model).__name__} is not a causal language model: context parallelism gathers a causal LM's "
            "per-position outputs back into whole rows, and this model's head reads positions of the whole row "
            "(a classifier's pooled token, a base model's states): use cp = 1 for this model"
        )
    whole_router_loss(model)  # (after the refusals: a refused model's modeling module is left as it was)
    cp = group_size(group)
    split = ContextSplit(group, comm, math.lcm(2 * cp, cp * sequence_split), average)
    attached = context_parallel_of(model)
    if attached is not None:
        if attached != split:
            raise ConfigError("the model is context-parallel over another group already; build it anew for this one")
        return
    unsplit = model.config._attn_implementation or "sdpa"  # (the model's own: decoding with a KV cache runs whole)
    use_context_attention(model)
    # before sequence parallelism's padding (a hook of the conversion): the split pads to a multiple of cp x tp
    # itself, and what it gathers back has the caller's length (SP's padding would have stayed in it)
    split_inputs = _SplitInputs(split, unsplit, inspect.signature(model.forward))
    model.register_forward_pre_hook(split_inputs, with_kwargs=True, prepend=True)
    model.register_forward_hook(_whole_outputs, with_kwargs=True)
    model.register_forward_hook(_context_attention_again, always_call=True)
    model.create_masks_for_generate = _OwnAttentionMasks(model, unsplit)
    setattr(model, _ATTACHED, split)


def context_parallel_of(model: Any) -> ContextSplit | None:
    """How a model :func:`attach_context_parallel` made context-parallel splits its batches, else ``None``."""
    return getattr(model, _ATTACHED, None)
