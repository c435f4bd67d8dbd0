"""The pipeline stages' side of an MoE model's load-balancing term (:mod:`mtk.parallel.router_loss` holds the loss):
the expert count and top-k the stages' routing sums need, the router logits every chunk records, and a chunk's sums
added to the ones it received (sent on with the hidden states: :mod:`mtk.pipeline.message`)."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from mtk.errors import UnsupportedModelError
from mtk.parallel.context import KEYWORD
from mtk.parallel.router_loss import router_loss_in_loss, routing_sums

__all__ = ["record_outputs_of_every_chunk", "router_shape", "stage_routing_sums"]


def record_outputs_of_every_chunk(model: nn.Module) -> None:
    """Install transformers' output-recording hooks (router logits, ...) now, while every chunk's layers are in the
    model: transformers installs them at the first call that records, on the modules in the model then, and a chunk's
    view has swapped the other chunks' layers out (its router logits would go unrecorded ever after)."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # a transformers without output capturing records nothing this way
        return
    decoder = cast(Any, model).base_model
    if getattr(type(decoder), "_can_record_outputs", None):
        maybe_install_capturing_hooks(decoder)


def router_shape(model: nn.Module) -> tuple[int, int]:
    """``(E, k)`` of a model whose loss has the router's load-balancing term (its causal LM's own attributes, as its
    forward passes them to ``load_balancing_loss_func``), else ``(0, 0)``."""
    config = cast(Any, model).config
    if not router_loss_in_loss(config):
        return 0, 0
    text = config.get_text_config()
    experts = getattr(model, "num_experts", None) or next(
        (
            getattr(text, name)
            for name in ("num_experts", "num_local_experts", "n_routed_experts")
            if hasattr(text, name)
        ),
        None,
    )
    top_k = getattr(model, "num_experts_per_tok", None) or getattr(text, "num_experts_per_tok", None)
    if not isinstance(experts, int) or not isinstance(top_k, int):
        raise UnsupportedModelError(
            f"{type(model).__name__}: a pipeline carries the router's load-balancing sums between stages and needs "
            "the model's num_experts and num_experts_per_tok, which it has not; set output_router_logits to false "
            "in the model's config, or use pp = 1"
        )
    return experts, top_k


def stage_routing_sums(
    router_logits: Any,
    inputs: dict[str, Any],
    sums_in: torch.Tensor | None,
    experts: int,
    top_k: int,
    device: torch.device,
) -> torch.Tensor:
    """``[2E + 1]`` fp32: a chunk's MoE layers' routing sums added to the ones it received, over the tokens the
    model's loss counts (its attention mask's; under CP, this rank's part of the rows)."""
    shard = inputs.get(KEYWORD)
    valid = shard.valid if shard is not None else inputs.get("attention_mask")
    logits = tuple(router_logits or ())  # [tokens, E] per MoE layer of this chunk
    if logits:
        sums = routing_sums(logits, experts, top_k, valid)  # [2E + 1]
        return sums if sums_in is None else sums + sums_in.to(device=sums.device, dtype=sums.dtype)
    if sums_in is not None:
        return sums_in.float()
    return torch.zeros(2 * experts + 1, dtype=torch.float32, device=device)  # no MoE layer yet
