"""What one TP rank holds, read off mtk's own conversion of the model on the meta device.

The planner's estimates and the prediction ``mtk bench`` counts its collectives against need the same
facts: the elements of each of a rank's parameters (what the DP reduction sends, what the distributed
optimizer all-gathers) and the replicated parameters of one block that sequence parallelism sums over TP.
Both come from the converted model itself (:func:`mtk.planner.trace.meta_model`: the model built from its
config on the meta device and converted by mtk's rules in a fake process group), never from a second
reading of the rules' style names, so a new parallel style is counted the moment it converts a model.
"""

from __future__ import annotations

import functools
import json
import warnings
from typing import Any

from transformers import PretrainedConfig

from mtk.parallel.distributed_optimizer import all_gather_rounds, assign_owners
from mtk.parallel.parameters import param_info
from mtk.planner.trace import TraceSettings, fake_process_group, meta_model, with_layers

__all__ = ["data_parallel_traffic", "has_residual_dropout", "local_numels", "sequence_parallel_elements"]


def local_numels(config: PretrainedConfig, tp_size: int) -> list[int]:
    """Elements of each of a TP rank's parameters, in the converted model's order (vocabulary padded, kv heads
    replicated, tied embeddings once)."""
    return list(_converted(_class_of(config), config.to_json_string(use_diff=False), tp_size, False)[0])


def sequence_parallel_elements(config: PretrainedConfig, tp_size: int) -> int:
    """Elements of one block's parameters that sequence parallelism marks (norm weights, row biases: replicated,
    applied to 1/tp of the sequence): what it sums over TP after backward."""
    one_layer = with_layers(config, 1)
    return _converted(_class_of(one_layer), one_layer.to_json_string(use_diff=False), tp_size, True)[1]


def _class_of(config: PretrainedConfig) -> Any:
    return type(config)  # a hashable cache key (mypy reads PretrainedConfig's __hash__ as an instance method)


@functools.lru_cache(maxsize=64)
def _converted(
    config_class: Any, config_json: str, tp_size: int, sequence_parallel: bool
) -> tuple[tuple[int, ...], int]:
    """(numel of each parameter, elements marked sequence-parallel) of TP rank 0 of the converted model."""
    config = config_class.from_dict(json.loads(config_json))
    with fake_process_group(tp_size), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes belong to a real run
        model = meta_model(config, TraceSettings(tp_size, sequence_parallel=sequence_parallel), pp=1, pp_rank=0)
        params = list(model.parameters())
    return tuple(p.numel() for p in params), sum(p.numel() for p in params if param_info(p).sequence_parallel)


def has_residual_dropout(config: PretrainedConfig) -> bool:
    """Whether a residual dropout with p > 0 follows the blocks' row-parallel layers."""
    return any(getattr(config, name, 0) or 0 for name in ("resid_pdrop", "hidden_dropout_prob", "hidden_dropout"))


def data_parallel_traffic(
    config: PretrainedConfig, tp_size: int, dp_size: int, distributed_optimizer: bool = False
) -> dict[str, Any]:
    """:func:`~mtk.planner.collectives.predict_collectives`' DP arguments for a one-stage replica: this rank's
    gradient elements and, with the distributed optimizer, the all-gather rounds (the same assignment
    ``shard_optimizer`` makes)."""

    if dp_size == 1:
        return {}
    numels = local_numels(config, tp_size)
    traffic: dict[str, Any] = {"dp_gradient_elements": sum(numels)}
    if distributed_optimizer:
        rounds = all_gather_rounds(numels, assign_owners(numels, dp_size), dp_size)
        traffic["all_gather_widths"] = tuple(max(sum(numels[i] for i in p) for p in pieces) for pieces in rounds)
    return traffic
