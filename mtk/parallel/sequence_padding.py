"""A batch whose length does not divide by the TP size, made to fit sequence parallelism without changing a result.

Sequence parallelism splits the positions between the TP blocks over the TP ranks (:mod:`mtk.convert.regions`),
so a forward needs ``s % tp == 0``. A user's own loop (or TRL's collator) pads to the longest example, not to a
multiple of ``tp``: :func:`pad_batch` appends ``tp - s % tp`` positions at the end of every row, and
:func:`trim_output` removes them from what the forward returns. Nothing real changes: the attention is causal, so no
real position attends to an appended one (an encoder's mask hides them); their labels are ``-100`` (ignored, and
not counted by ``num_items_in_batch``); their attention mask is 0. Megatron asks the data to be padded instead.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

from mtk.data.formats import IGNORE_INDEX
from mtk.errors import ConfigError

__all__ = [
    "PER_POSITION",
    "carries_cache",
    "keep_logits",
    "named_arguments",
    "pad_batch",
    "pop_logits_to_keep",
    "row_inputs",
    "trim_output",
]

# The keywords of a forward's KV cache (a decoding call's: generate passes one from the prompt on): transformers 5.2x's
# name and the older one.
CACHE_KEYWORDS = ("cache", "past_key_values")

_FILL = {"labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX, "attention_mask": 0}
# What a forward returns per position, trimmed back: HF's logits and hidden states, TRL's fused-head fields.
PER_POSITION = (
    "logits", "hidden_states", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask",
)  # fmt: skip


def named_arguments(signature: inspect.Signature, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A forward's arguments by name (``model(ids, mask)`` read as ``input_ids=ids, attention_mask=mask``), for a
    hook that changes a call's positions: every positional one counts. What a ``**kwargs`` parameter gathers stands
    beside the named ones, as the caller passed it."""
    named = dict(signature.bind_partial(*args, **kwargs).arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is parameter.VAR_KEYWORD:
            named.update(named.pop(parameter.name, {}))
    return named


def row_inputs(kwargs: dict[str, Any]) -> Any:
    """A forward's ``[b, s, ...]`` inputs: ``input_ids``, else ``inputs_embeds`` (``input_ids=None`` beside
    embeddings, as ``generate`` passes them, is no input)."""
    given = kwargs.get("input_ids")
    return kwargs.get("inputs_embeds") if given is None else given


def carries_cache(kwargs: dict[str, Any]) -> bool:
    """Whether a forward's keyword arguments carry a KV cache (a decoding call)."""
    return any(kwargs.get(name) is not None for name in CACHE_KEYWORDS)


def pop_logits_to_keep(kwargs: dict[str, Any]) -> int | torch.Tensor:
    """A forward's ``logits_to_keep`` (transformers < 4.50: ``num_logits_to_keep``), taken out of ``kwargs``: a hook
    that changes the positions a call sees applies it to the logits of the caller's positions (:func:`keep_logits`);
    the model would keep its own last positions, an appended pad's or another rank's. 0 keeps every position."""
    kept: int | torch.Tensor = 0
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in kwargs:
            kept = kwargs.pop(name)
    return kept


def keep_logits(output: Any, kept: int | torch.Tensor) -> Any:
    """``output`` with its logits cut to ``kept`` (:func:`pop_logits_to_keep`) as HF's head cuts its hidden states:
    the last ``kept`` positions, the positions a tensor names, a boolean mask's; a chunked loss's stand-in
    (which holds nothing) stays."""
    logits = getattr(output, "logits", None)
    if isinstance(kept, int) and kept == 0 or not isinstance(logits, torch.Tensor) or not any(logits.stride()):
        return output
    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:  # (transformers < 5: an int or a 1-d tensor of positions)
        output["logits"] = logits[:, slice(-kept, None) if isinstance(kept, int) else kept]
    else:
        output["logits"] = slice_logits_to_keep(logits, kept)
    return output


def pad_batch(
    batch: dict[str, Any],
    multiple: int,
    pad_token_id: int | None = None,
    max_positions: int | None = None,
    causal: bool = True,
    reason: str = "sequence parallelism",
) -> tuple[dict[str, Any], int]:
    """``batch`` with every per-position tensor (``[b, s, ...]``) padded at the end to a multiple of ``multiple``
    positions, and how many positions were added (0: the batch is returned as it is).

    ``causal``: no position attends to a later one, so the appended ones need no mask; otherwise (an encoder) a
    batch without ``attention_mask`` gets one that hides them, and ``pad_token_id`` must say what they hold (a
    sequence classifier finds each row's last real token by it). ``reason``: what needs the multiple, for messages."""
    inputs = row_inputs(batch)
    if inputs is None or multiple <= 1:
        return batch, 0
    rows, length = inputs.shape[:2]
    extra = -length % multiple
    if extra == 0:
        return batch, 0
    mask = batch.get("attention_mask")
    what = f"{reason} (rows padded to a multiple of {multiple} positions)"
    if mask is not None and mask.dim() != 2:
        raise ConfigError(
            f"{what} with a {mask.dim()}-d attention mask and {length} positions: "
            f"mtk pads 2-d masks only; pad the batch to a multiple of {multiple} positions"
        )
    if max_positions is not None and length + extra > max_positions:
        raise ConfigError(
            f"{what}: {length} positions would be padded to {length + extra}, "
            f"past the model's {max_positions}; use at most {max_positions - max_positions % multiple} positions"
        )
    if not causal and batch.get("input_ids") is None:  # (embeddings alone: no pad id tells HF where a row ends)
        raise ConfigError(
            f"{what} with inputs_embeds alone and {length} positions: a model that is not a causal LM reads a row's "
            "last position by its pad ids (a sequence classifier's pooled token), and without input_ids that "
            f"would be an appended one; pass input_ids, or embeddings of a multiple of {multiple} positions"
        )
    if not causal and pad_token_id is None:
        raise ConfigError(
            f"{what} with {length} positions: mtk pads an encoder's batch with "
            f"the model's pad_token_id, which is not set; set config.pad_token_id or pad to a multiple of {multiple}"
        )
    if not causal and mask is None:  # [b, s]: every given position is real
        batch = {**batch, "attention_mask": torch.ones(rows, length, dtype=torch.long, device=inputs.device)}
    positions = batch.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[0] == 1 and rows > 1:
        batch = {**batch, "position_ids": positions.expand(rows, -1)}  # [1, s] -> [b, s]: HF broadcasts them
    padded = dict(batch)
    for key, value in batch.items():
        if not (isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (rows, length)):
            continue
        if key == "position_ids":  # [b, s]: counting on from each row's last position
            steps = torch.arange(1, extra + 1, device=value.device, dtype=value.dtype)
            padded[key] = torch.cat([value, value[:, -1:] + steps], dim=1)
            continue
        fill = _FILL.get(key, pad_token_id if key == "input_ids" and pad_token_id is not None else 0)
        ends = (0, 0) * (value.dim() - 2) + (0, extra)  # F.pad's pairs run from the last dimension back
        padded[key] = F.pad(value, ends, value=fill)  # [b, s + extra, ...]
    return padded, extra


def trim_output(output: Any, extra: int, padded_length: int) -> Any:
    """A forward's output (a ``ModelOutput``) without the ``extra`` positions :func:`pad_batch` appended to make
    ``padded_length``: every per-position field (``[b, padded_length, ...]``, or one shorter when shifted for the
    loss) loses its last ``extra``; anything else (a classifier's ``[b, labels]`` logits) stays."""
    if extra == 0 or output is None:
        return output

    def trimmed(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):  # (a layer output_hidden_states=[i] did not select: None)
            return value
        per_position = value.dim() >= 2 and value.shape[1] in (padded_length, padded_length - 1)
        return value[:, : value.shape[1] - extra] if per_position else value  # [b, s' - extra, ...]

    def trimmed_weights(value: Any) -> Any:  # [b, h, q, k] attention weights: queries and keys
        if not (isinstance(value, torch.Tensor) and value.dim() == 4 and value.shape[-2:] == (padded_length,) * 2):
            return value
        return value[:, :, : padded_length - extra, : padded_length - extra]

    for name in PER_POSITION:
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            setattr(output, name, trimmed(value))
        elif isinstance(value, tuple):
            setattr(output, name, tuple(trimmed(v) for v in value))
    weights = getattr(output, "attentions", None)
    if isinstance(weights, tuple):
        output["attentions"] = tuple(trimmed_weights(v) for v in weights)
    return output
