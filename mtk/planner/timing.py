"""Communication per step and a roofline step time for one layout.

Communication is what mtk issues, from :func:`mtk.planner.collectives.predict_collectives` (the prediction the
bench checks against counted collectives): TP all-reduces / all-gathers / reduce-scatters, the pipeline's
sends and receives, and the DP gradient reduction. Times are bytes on the wire over the link the group
sits on: a ring all-reduce moves ``2 (n-1)/n`` of its buffer per rank, an all-gather ``(n-1)`` inputs, a
reduce-scatter ``(n-1)/n`` of its input.

The step time is a roofline, not a simulation: compute at the GPU's peak FLOP/s (``6 N`` FLOPs per token for
the matmuls, ``4 N`` with a frozen LoRA base, ``+ 2 N`` for full recompute, plus ``12 L s q`` for attention
scores, ``q`` the query width) on the slowest pipeline rank (its decoder layers, plus the LM head's
:func:`~mtk.pipeline.balance.head_weight` layers on the last), TP communication not overlapped (mtk waits for
each all-reduce), the pipeline's bubble overhead ``(p - 1) / (v m)`` of a stage's step on top
(:func:`~mtk.pipeline.schedules.bubble_overhead`; ``v`` chunks per rank with the interleaved schedule),
blocking P2P, and the DP reduction exposed beyond the backward it overlaps (DDP / DeepSpeed at ``pp = 1``:
two thirds of the compute; a pipeline: its last micro-batch's backward; the distributed optimizer's
all-gather: none). It ranks layouts; the
absolute figure is a lower bound a real run approaches, not a promise.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

from transformers import PretrainedConfig

from mtk.models import attention_heads, auto_class_for, num_layers

__all__ = ["ModelSize", "StepTime", "Traffic", "model_size"]


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts of the whole model (from a meta-device copy; nothing allocated)."""

    parameters: int
    matmul_parameters: int  # a token's: without the input embedding (a lookup), with the LM head, k of E experts
    layers: int
    hidden: int
    query_width: int  # heads x head dim


@functools.lru_cache(maxsize=16)
def _size(config_class: Any, config_json: str) -> ModelSize:
    import json

    import torch

    config = config_class.from_dict(json.loads(config_json))
    with torch.device("meta"):
        model = auto_class_for(config).from_config(config)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embedding
    matmul = total - (0 if tied else embedding.numel())
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    for experts in (m for m in model.modules() if hasattr(m, "num_experts") and hasattr(m, "down_proj")):
        stored = sum(p.numel() for p in experts.parameters(recurse=False))  # a token runs k of the E experts
        matmul -= stored - stored * min(top_k or experts.num_experts, experts.num_experts) // experts.num_experts
    heads, _, head_dim = attention_heads(config)
    return ModelSize(total, matmul, num_layers(config), config.hidden_size, heads * head_dim)


def model_size(config: PretrainedConfig) -> ModelSize:
    config_class: Any = type(config)
    return _size(config_class, config.to_json_string(use_diff=False))


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends per optimizer step, by group (collective inputs, as the bench counts them)."""

    tp_bytes: int
    pp_bytes: int
    dp_bytes: int
    tp_wire_s: float  # seconds on the TP group's link
    pp_wire_s: float
    dp_wire_s: float
    cp_bytes: int = 0  # context-parallel attention's sends (ring) or all-to-alls
    cp_wire_s: float = 0.0
    ep_bytes: int = 0  # expert parallelism's all-to-alls (the tokens to their experts and back)
    ep_wire_s: float = 0.0


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on the slowest stage (``bubble``: the pipeline's idle seconds), and the
    bubble overhead behind it: idle time over the stage's time, ``(p - 1) / (v m)``."""

    compute: float
    tp_communication: float
    bubble: float
    p2p: float
    dp_exposed: float
    total: float
    bubble_overhead: float
    cp_exposed: float = 0.0  # context-parallel attention's traffic the attention compute does not hide
    ep_exposed: float = 0.0  # expert parallelism's all-to-alls: the experts wait for their tokens

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def flops_per_token(size: ModelSize, seq: int, *, lora: bool, recompute: str | None) -> float:
    """Training FLOPs per token of the whole model (forward + backward, recompute included)."""
    matmul = (4 if lora else 6) * size.matmul_parameters
    attention = 12 * size.layers * seq * size.query_width  # QK^T and AV: 4 s q forward, twice that backward
    if recompute == "full":
        matmul += 2 * size.matmul_parameters
        attention += 4 * size.layers * seq * size.query_width
    elif recompute == "selective":  # only what lies between the matmuls: the attention core
        attention += 4 * size.layers * seq * size.query_width
    return matmul + attention


def collective_seconds(kind: str, nbytes: int, ranks: int, bandwidth: float) -> float:
    """Time on the wire of ``nbytes`` handed to collectives of ``kind`` in a group of ``ranks``."""
    if ranks <= 1 and kind not in ("send", "recv"):
        return 0.0
    factor = {
        "all_reduce": 2 * (ranks - 1) / ranks,
        "all_gather": ranks - 1,
        "reduce_scatter": (ranks - 1) / ranks,
        "all_to_all": (ranks - 1) / ranks,  # all but this rank's own share leaves it
        "send": 1.0,
        "recv": 0.0,  # the sender's time
        "broadcast": 0.0,  # the 4-byte loss
    }[kind]
    return factor * nbytes / bandwidth
