"""The router's load-balancing loss of an MoE model under context parallelism, as one process computes it.

transformers' ``load_balancing_loss_func`` (Switch Transformer's ``E · Σ_e f_e · P_e``, in each MoE model's
modeling module) multiplies two means over every token and layer of the call: the share of routing choices each
expert gets and its mean router probability. A CP rank holds part of each row, and the mean of the ranks' losses is
not the whole row's (tiny-qwen3-moe at CP 2 logged 5.59682 against 5.59659). While a context-parallel call runs
(:func:`set_active`), the module's function is :func:`_whole_rows_loss` instead: each rank sums its tokens'
choices, probabilities and count (the split's padding left out, as the unsplit model's mask leaves padding out),
one all-reduce over the CP group adds them up, and the whole rows' loss follows on every rank. Its gradient reaches
this rank's tokens scaled as the split's token loss is (``cp`` times its share where the CP ranks' gradients are
averaged), so the averaged gradients are one process's. Outside such a call the function is transformers' own.
"""

from __future__ import annotations

import contextvars
import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from mtk.parallel.comm import all_reduce, group_size

if TYPE_CHECKING:
    from mtk.parallel.context import ContextShard

__all__ = ["has_router_loss_function", "router_loss_in_loss", "set_active", "sum_router_loss_over_context"]

_FUNCTION = "load_balancing_loss_func"
_WRAPPED = "mtk_context_parallel"
_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("mtk_router_loss_shard", default=None)


def router_loss_in_loss(config: Any) -> bool:
    """Whether ``config``'s model adds the router's load-balancing term to its loss."""
    return bool(getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0))


def has_router_loss_function(config: Any) -> bool:
    """Whether the causal LM transformers builds for ``config`` computes its load-balancing loss with a module-level
    ``load_balancing_loss_func`` (what :func:`sum_router_loss_over_context` replaces)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError):
        return False
    return callable(getattr(sys.modules.get(model_class.__module__), _FUNCTION, None))


def sum_router_loss_over_context(model: Any) -> bool:
    """Route the load-balancing loss of ``model`` (any wrapper of it: a ``PeftModel``, a stage) through
    :func:`_whole_rows_loss` while a context-parallel call runs: in every modeling module its modules' classes come
    from; ``False`` when none of them has a ``load_balancing_loss_func`` to replace."""
    modules = {sys.modules.get(type(m).__module__) for m in model.modules()}
    found = False
    for module in modules:
        original = getattr(module, _FUNCTION, None)
        if not callable(original):
            continue
        found = True
        if not getattr(original, _WRAPPED, False):
            wrapper = functools.wraps(original)(functools.partial(_whole_rows_loss, original))
            setattr(wrapper, _WRAPPED, True)
            setattr(module, _FUNCTION, wrapper)
    return found


def set_active(shard: ContextShard | None) -> None:
    """Mark the call now running as this rank's ``shard`` of a split batch (``None``: no split call runs)."""
    _ACTIVE.set(shard)


def _whole_rows_loss(
    original: Callable[..., Any],
    gate_logits: Any,
    num_experts: int | None = None,
    top_k: int = 2,
    attention_mask: torch.Tensor | None = None,
) -> Any:
    """``E · Σ_e f_e · P_e`` over the whole rows of the CP group's tokens (transformers' own outside a split call)."""
    shard = _ACTIVE.get()
    if shard is None or not isinstance(gate_logits, tuple) or not gate_logits or num_experts is None:
        return original(gate_logits, num_experts, top_k, attention_mask)
    device = gate_logits[0].device
    valid = shard.valid.reshape(-1).to(device=device, dtype=torch.float32)  # [b * s/cp]: padding 0
    if gate_logits[0].shape[0] != valid.numel():  # not this split's call (a stale mark): transformers' own
        return original(gate_logits, num_experts, top_k, attention_mask)
    choices = torch.zeros(num_experts, dtype=torch.float32, device=device)  # [E]
    probabilities = torch.zeros(num_experts, dtype=torch.float32, device=device)  # [E]
    for layer_gate in gate_logits:  # [b * s/cp, E] per MoE layer
        weights = F.softmax(layer_gate.to(device), dim=-1)
        _, selected = torch.topk(weights, top_k, dim=-1)  # [b * s/cp, k]
        choices = choices.scatter_add(0, selected.reshape(-1), valid.repeat_interleave(top_k))
        probabilities = probabilities + (weights.float() * valid.unsqueeze(-1)).sum(dim=0)
    rows = valid.sum() * len(gate_logits)
    summed = all_reduce(torch.cat([choices, probabilities.detach(), rows.reshape(1)]), shard.group)  # [2E + 1]
    total_choices, total_probabilities, total_rows = summed[:num_experts], summed[num_experts:-1], summed[-1]
    scale = group_size(shard.group) if shard.average else 1  # as the split's token loss: cp x this rank's share
    whole = probabilities * scale + (total_probabilities - probabilities.detach() * scale)  # value: the group's sum
    return torch.sum((total_choices / total_rows) * (whole / total_rows)) * num_experts
