"""The router's load-balancing loss of an MoE model under context and pipeline parallelism, as one process computes it.

transformers' ``load_balancing_loss_func`` (Switch Transformer's ``E · Σ_e f_e · P_e``, in each MoE model's
modeling module) multiplies two means over every token and layer of the call: the share of routing choices each
expert gets and its mean router probability. Both are sums divided by one count, so the loss follows from
:func:`routing_sums` (``[2E + 1]``: choices, probabilities, count) added up over whatever holds part of the call:

- **Context parallelism.** A CP rank holds part of each row, and the mean of the ranks' losses is not the whole
  row's (tiny-qwen3-moe at CP 2 logged 5.59682 against 5.59659). While a context-parallel call runs
  (:func:`set_active`), each rank sums its tokens (the split's padding left out, as the unsplit model's mask leaves
  padding out) and one all-reduce over the CP group adds them up. The gradient reaches this rank's tokens scaled as
  the split's token loss is (``cp`` times its share where the CP ranks' gradients are averaged), so the averaged
  gradients are one process's.
- **A pipeline.** A stage holds some layers' routers, and its last stage's loss over its own layers is not the
  model's (tiny-qwen3-moe at PP 2 logged 5.597176 where one process accumulating the same 4 micro-batches logs
  5.596632). Each stage adds its layers' sums to the ones it received and sends them on with the hidden states
  (:mod:`mtk.pipeline.message`); the last stage's loss adds its own to the ones carried in (:func:`carrying`), and
  their gradient goes back the same way, as Megatron-Core's ``MoEAuxLossAutoScaler`` sends its loss's gradient back
  through the schedule.

While neither applies, the function is transformers' own. :func:`replace_load_balancing_loss` puts
:func:`load_balancing_loss` in its place in the model's modeling modules; mtk's own callers (TRL's fused head) call
it directly. :func:`whole_router_loss` does so for a model under CP or a pipeline, or refuses in one line a model
whose modeling code computes the term some other way (:func:`router_loss_refusal`, which the planner asks too).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from mtk.errors import ConfigError, UnsupportedModelError
from mtk.parallel.comm import all_reduce, group_size

if TYPE_CHECKING:
    from mtk.parallel.context import ContextShard

__all__ = [
    "ROUTER_LOSS_LIMITS",
    "carrying",
    "has_router_loss_function",
    "load_balancing_loss",
    "replace_load_balancing_loss",
    "router_loss_in_loss",
    "router_loss_refusal",
    "routing_sums",
    "set_active",
    "whole_router_loss",
]

_FUNCTION = "load_balancing_loss_func"
_MIXTRAL = "transformers.models.mixtral.modeling_mixtral"
_WRAPPED = "mtk_load_balancing"
_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("mtk_router_loss_shard", default=None)
_CARRIED: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("mtk_router_sums", default=None)


def router_loss_in_loss(config: Any) -> bool:
    """Whether ``config``'s model adds the router's load-balancing term to its loss."""
    return bool(getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0))


def has_router_loss_function(config: Any) -> bool:
    """Whether the causal LM transformers builds for ``config`` computes its load-balancing loss with a module-level
    ``load_balancing_loss_func`` (what :func:`replace_load_balancing_loss` replaces)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError):
        return False
    return callable(getattr(sys.modules.get(model_class.__module__), _FUNCTION, None))


def replace_load_balancing_loss(model: Any) -> bool:
    """Route the load-balancing loss of ``model`` (any wrapper of it: a ``PeftModel``, a stage) through
    :func:`load_balancing_loss`: in every modeling module its modules' classes come from, and in Mixtral's (which TRL's
    fused head calls for every MoE family); ``False`` when none of them has a ``load_balancing_loss_func`` to
    replace."""
    modules = {sys.modules.get(type(m).__module__) for m in model.modules()}
    found = any(callable(getattr(module, _FUNCTION, None)) for module in modules)
    if found:  # TRL's fused head computes every MoE family's term with Mixtral's function
        modules.add(importlib.import_module(_MIXTRAL))
    for module in modules:
        original = getattr(module, _FUNCTION, None)
        if callable(original) and not getattr(original, _WRAPPED, False):
            wrapper = functools.wraps(original)(functools.partial(load_balancing_loss, original))
            setattr(wrapper, _WRAPPED, True)
            setattr(module, _FUNCTION, wrapper)
    return found


def set_active(shard: ContextShard | None) -> None:
    """Mark the call now running as this rank's ``shard`` of a split batch (``None``: no split call runs)."""
    _ACTIVE.set(shard)


@contextlib.contextmanager
def carrying(sums: torch.Tensor | None) -> Iterator[None]:
    """While the block runs, the load-balancing loss adds ``sums`` (``[2E + 1]``: the earlier pipeline stages'
    :func:`routing_sums` of this micro-batch) to its own layers'."""
    token = _CARRIED.set(sums)
    try:
        yield
    finally:
        _CARRIED.reset(token)


def routing_sums(
    gate_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int, valid: torch.Tensor | None
) -> torch.Tensor:
    """``[2E + 1]`` fp32: each expert's routing choices and router probability summed over the ``valid`` tokens
    (``[tokens]``, 0 for padding; ``None``: all) of every layer's ``[tokens, E]`` logits, then their count (tokens x
    layers), as transformers' ``load_balancing_loss_func`` sums them. The probabilities carry the gradient."""
    device = gate_logits[0].device
    choices = torch.zeros(num_experts, dtype=torch.float32, device=device)  # [E]
    probabilities = torch.zeros(num_experts, dtype=torch.float32, device=device)  # [E]
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for layer_gate in gate_logits:  # [tokens, E] per MoE layer
        weights = F.softmax(layer_gate.to(device), dim=-1)
        _, selected = torch.topk(weights, top_k, dim=-1)  # [tokens, k]
        if valid is None:
            mask = torch.ones(layer_gate.shape[0], dtype=torch.float32, device=device)  # [tokens]
        elif valid.numel() == layer_gate.shape[0]:
            mask = valid.reshape(-1).to(device=device, dtype=torch.float32)
        else:
            raise ConfigError(
                f"the router's load-balancing loss got {layer_gate.shape[0]} tokens of router logits and a mask of "
                f"{valid.numel()}; pass an attention_mask of shape [batch, sequence] (or none)"
            )
        choices = choices.scatter_add(0, selected.reshape(-1), mask.repeat_interleave(top_k))
        probabilities = probabilities + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
        rows = rows + mask.sum()
    return torch.cat([choices, probabilities, rows.reshape(1)])  # [2E + 1]


def load_balancing_loss(
    original: Callable[..., Any],
    gate_logits: Any,
    num_experts: int | None = None,
    top_k: int = 2,
    attention_mask: torch.Tensor | None = None,
) -> Any:
    """``E · Σ_e f_e · P_e`` over the whole rows of the CP group's tokens and every pipeline stage's layers
    (``original``, transformers' own, where neither holds part of the call)."""
    shard, carried = _ACTIVE.get(), _CARRIED.get()
    if shard is None and carried is None:
        return original(gate_logits, num_experts, top_k, attention_mask)
    valid = attention_mask
    stale = shard is not None and bool(gate_logits) and gate_logits[0].shape[0] != shard.valid.numel()
    if not isinstance(gate_logits, tuple) or num_experts is None or stale:
        if carried is not None:  # the earlier stages' routing sums would be dropped without a word
            raise ConfigError(
                "the model's load_balancing_loss_func got no router logits tuple and expert count (or logits of "
                "another split) on a pipeline's last stage, which must add the earlier stages' routing sums; set "
                "output_router_logits to false in the model's config, or use pp = 1"
            )
        return original(gate_logits, num_experts, top_k, attention_mask)  # not this split's call (a stale mark)
    if shard is not None:
        valid = shard.valid  # [b, s/cp]: padding False
    if not gate_logits and carried is None:
        return original(gate_logits, num_experts, top_k, attention_mask)
    sums = routing_sums(gate_logits, num_experts, top_k, valid) if gate_logits else None  # [2E + 1]
    if carried is not None:
        if carried.numel() != 2 * num_experts + 1:
            raise ConfigError(
                f"the pipeline carried routing sums of {(carried.numel() - 1) // 2} experts to a loss over "
                f"{num_experts}; the model's stages must route over the same experts"
            )
        carried = carried.float()  # fp32 sums (an fp64 pipeline carries them as fp64: the same values)
        sums = carried if sums is None else sums + carried.to(sums.device)
    assert sums is not None
    return _balance(sums, num_experts, shard)


def _balance(sums: torch.Tensor, num_experts: int, shard: ContextShard | None) -> torch.Tensor:
    """The loss of :func:`routing_sums` (``[2E + 1]``), added up over the CP group where a split call runs."""
    choices, probabilities, rows = sums[:num_experts], sums[num_experts:-1], sums[-1]
    if shard is None:
        return torch.sum((choices / rows) * (probabilities / rows)) * num_experts
    summed = all_reduce(sums.detach().clone(), shard.group)  # [2E + 1]
    total_choices, total_probabilities, total_rows = summed[:num_experts], summed[num_experts:-1], summed[-1]
    scale = group_size(shard.group) if shard.average else 1  # as the split's token loss: cp x this rank's share
    whole = probabilities * scale + (total_probabilities - probabilities.detach() * scale)  # value: the group's sum
    return torch.sum((total_choices / total_rows) * (whole / total_rows)) * num_experts


ROUTER_LOSS_LIMITS = {
    # parallelism -> what else to do
    "context parallelism": "train without CP",
    "pipeline parallelism": "use pp = 1",
}


def router_loss_refusal(config: Any, parallelism: str = "context parallelism") -> str | None:
    """Why ``parallelism`` cannot run ``config``'s MoE loss (``None``: it can). The router's load-balancing loss
    multiplies two means over the tokens and layers of the call: summed over a CP group and carried through a
    pipeline's stages (:mod:`mtk.parallel.router_loss`) wherever the model's modeling code computes it with
    transformers' ``load_balancing_loss_func`` (every MoE model transformers ships)."""
    if router_loss_in_loss(config) and not has_router_loss_function(config):
        return _needs_loss_function(config.model_type, parallelism)
    return None


def _needs_loss_function(what: str, parallelism: str) -> str:
    return (
        f"{what}: {parallelism} with the router's load-balancing loss in the loss needs transformers' "
        f"load_balancing_loss_func in the model's modeling code, which it has not; set output_router_logits to "
        f"false in the model's config, or {ROUTER_LOSS_LIMITS[parallelism]}"
    )


def whole_router_loss(model: Any, parallelism: str = "context parallelism") -> None:
    """Make ``model``'s load-balancing loss (if its loss has one) the whole call's under ``parallelism``
    (:func:`~mtk.parallel.router_loss.replace_load_balancing_loss`), or refuse it in one line."""
    config = getattr(model, "config", None)
    refusal = router_loss_refusal(config, parallelism)
    # (replaced even where the config leaves the term out: a call may ask for it, output_router_logits=True)
    if refusal is None and not replace_load_balancing_loss(model) and router_loss_in_loss(config):
        refusal = _needs_loss_function(type(model).__name__, parallelism)
    if refusal is not None:
        raise UnsupportedModelError(refusal)
