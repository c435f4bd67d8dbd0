"""How many decoder layers each pipeline stage gets: the one rule the runtime, the planner and the bench use.

A stage's time is its decoder layers plus what only the first or last stage runs. The last stage also runs
the LM head and the loss, whose matmul (``vocab x hidden``) is worth several decoder layers on a model with a
large vocabulary and a small hidden size; an even split of the layers then leaves every other stage waiting
for the last one. Megatron-Core's ``account_for_loss_in_pipeline_split`` counts the head and loss as one more
layer of the last stage; mtk weighs it instead, as its matmul against one decoder layer's
(:func:`head_weight`: parameters of the matrices, read off a one-layer copy of the model built on the meta
device, so any architecture the rules can cut is weighed the same way), rounds that to whole layers
(:func:`head_layers`) and splits ``layers + head`` evenly, the head counting on the last stage:

    bench-llama (4 layers, hidden 512, vocabulary 8192): head = 8192 x 512 / 2.9 M = 1.45 layers -> 1;
    pp = 2: 5 units -> [3, 2] -> [3, 1] (the hand-balanced split of docs/bench.md)

The input embedding is a lookup, not a matmul (Megatron's ``account_for_embedding_in_pipeline_split`` is
for memory, not time): it weighs nothing. With the interleaved schedule the model is cut into ``pp x v``
chunks the same way, the model's last chunk carrying the head. No stage is ever left without a layer, and a
split given explicitly (``--pipeline_layers``, ``MTK_PIPELINE_LAYERS``,
``decoder_last_pipeline_num_layers``) is used as given.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from mtk.config import RunSettings
from mtk.errors import ConfigError, UnsupportedModelError
from mtk.models import auto_class_for, num_layers, whole_parameters, with_layers

__all__ = ["asked_layers", "head_layers", "head_weight", "layer_counts", "rank_layers", "stage_layer_counts"]


def _even(count: int, parts: int) -> list[int]:
    """``count`` split into ``parts`` as evenly as possible, earlier parts taking the remainder."""
    base, extra = divmod(count, parts)
    return [base + (1 if part < extra else 0) for part in range(parts)]


def asked_layers(settings: RunSettings, num_layers: int, pp_size: int) -> tuple[int, ...]:
    """Decoder blocks per stage as the run's settings ask (``pipeline_layers``; or ``last_stage_layers``, Megatron's
    ``decoder_last_pipeline_num_layers``, with the rest split evenly); ``()``: mtk's head-aware default."""
    last = settings.last_stage_layers
    if settings.pipeline_layers or last is None or pp_size == 1:  # (at pp 1: RunSettings.check_pipeline says so)
        return settings.pipeline_layers
    if num_layers - last < pp_size - 1:
        raise ConfigError(
            f"decoder_last_pipeline_num_layers={last} leaves {num_layers - last} of the model's {num_layers} "
            f"layers for the other {pp_size - 1} stages; each needs at least one"
        )
    return (*_even(num_layers - last, pp_size - 1), last)


def stage_layer_counts(
    num_layers: int, num_stages: int, requested: tuple[int, ...] = (), head_layers: int = 0
) -> list[int]:
    """Decoder blocks per stage (per model chunk with the interleaved schedule: ``num_stages`` is then
    ``pp * v``): ``requested`` if given, else ``num_layers + head_layers`` units as even as possible (earlier
    stages take the remainder), the last stage's share less the head's ``head_layers``, and at least one."""
    if requested:
        if len(requested) != num_stages or sum(requested) != num_layers or min(requested) < 1:
            raise UnsupportedModelError(
                f"pipeline layers {list(requested)} must be {num_stages} positive counts (one per stage, or per "
                f"model chunk with virtual stages) summing to the model's "
                f"{num_layers} layers"
            )
        return list(requested)
    if num_layers < num_stages:
        raise UnsupportedModelError(
            f"the model has {num_layers} layers, fewer than the {num_stages} pipeline stages (pp x virtual stages); "
            f"use at most {num_layers}"
        )
    if num_stages == 1:
        return [num_layers]
    last = max(1, (num_layers + head_layers) // num_stages - head_layers)  # the last stage's share of the units
    return [*_even(num_layers - last, num_stages - 1), last]


def rank_layers(counts: list[int], pp_size: int) -> list[int]:
    """Decoder blocks per pipeline rank: rank ``s`` runs chunks ``s, s + pp, ...`` of the split."""
    return [sum(counts[stage::pp_size]) for stage in range(pp_size)]


def layer_counts(config: PretrainedConfig, num_stages: int, requested: tuple[int, ...] = ()) -> list[int]:
    """The split mtk uses for this model: ``requested`` if given, else the head-aware default."""
    head = 0 if requested or num_stages == 1 else head_layers(config)
    return stage_layer_counts(num_layers(config), num_stages, requested, head)


def head_layers(config: PretrainedConfig) -> int:
    """The LM head and loss in whole decoder layers of work (:func:`head_weight`, rounded half up)."""
    return math.floor(head_weight(config) + 0.5)


def head_weight(config: PretrainedConfig) -> float:
    """The LM head's matmul against one decoder layer's: ``vocab x hidden`` over the elements of the layer's
    matrices (biases and norms are not matmuls; a mixture of experts counts every expert)."""
    config_class: Any = type(config)
    return _head_weight(config_class, config.to_json_string(use_diff=False))


@functools.lru_cache(maxsize=16)
def _head_weight(config_class: Any, config_json: str) -> float:
    config = with_layers(config_class.from_dict(json.loads(config_json)), 1)
    with torch.device("meta"), whole_parameters():
        model = auto_class_for(config).from_config(config)
    head = model.get_output_embeddings()
    if head is None:
        return 0.0
    outside = {id(head.weight)} | {
        id(param) for module in model.modules() if isinstance(module, nn.Embedding) for param in module.parameters()
    }
    layer = sum(param.numel() for param in model.parameters() if param.dim() >= 2 and id(param) not in outside)
    return head.weight.numel() / layer if layer else 0.0
