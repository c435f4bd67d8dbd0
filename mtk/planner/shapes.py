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
from dataclasses import dataclass
from typing import Any, cast

from transformers import PretrainedConfig

from mtk.models import num_layers
from mtk.parallel.distributed_optimizer import all_gather_rounds, assign_owners
from mtk.parallel.fsdp import sharded_modules
from mtk.parallel.parameters import param_info
from mtk.parallel.router_loss import router_loss_in_loss
from mtk.planner.trace import TraceSettings, fake_process_group, meta_model, with_layers

__all__ = [
    "all_gather_widths",
    "data_parallel_traffic",
    "expert_flags",
    "expert_parallel_refusal",
    "fsdp_traffic",
    "has_residual_dropout",
    "local_numels",
    "moe_layers",
    "sequence_parallel_elements",
    "stage_moe_layers",
    "tp_shared_numels",
]


def local_numels(config: PretrainedConfig, tp_size: int, etp_size: int | None = None) -> list[int]:
    """Elements of each of a TP rank's parameters, in the converted model's order (vocabulary padded, kv heads
    replicated, tied embeddings once; at the experts' TP size 1, every expert whole)."""
    return list(_converted(_class_of(config), config.to_json_string(use_diff=False), tp_size, False, etp_size).numels)


def expert_flags(config: PretrainedConfig, tp_size: int, etp_size: int | None = None) -> list[bool]:
    """Whether each of :func:`local_numels`' parameters is an MoE layer's 3D expert tensor (what expert parallelism
    spreads)."""
    return list(_converted(_class_of(config), config.to_json_string(use_diff=False), tp_size, False, etp_size).experts)


def moe_layers(config: PretrainedConfig) -> int:
    """MoE layers of the model (modules holding 3D expert tensors): 0 for a dense model."""
    return _converted(_class_of(config), config.to_json_string(use_diff=False), 1, False).moe_layers


def router_experts(config: PretrainedConfig) -> int:
    """E where the model's loss has the router's load-balancing term (summed over a CP group, carried through a
    pipeline's stages), else 0."""
    if not router_loss_in_loss(config):
        return 0
    return _converted(_class_of(config), config.to_json_string(use_diff=False), 1, False).experts_per_layer


def every_layer_moe(config: PretrainedConfig) -> bool:
    """Whether every decoder layer is an MoE layer (then a pipeline stage's MoE layers are its layers)."""
    return moe_layers(config) == num_layers(config)


def stage_moe_layers(config: PretrainedConfig, stage_layers: int, pp_size: int) -> int:
    """MoE layers among a stage's ``stage_layers`` decoder layers: known where every layer is one (or pp is 1)."""
    return stage_layers if every_layer_moe(config) else (moe_layers(config) if pp_size == 1 else 0)


def expert_parallel_refusal(config: PretrainedConfig, ep_size: int) -> str | None:
    """Why the experts of ``config`` cannot spread over ``ep_size`` ranks (``None``: they can): a dense model, or
    experts that do not divide evenly (as :func:`~mtk.parallel.expert_parallel.distribute_experts` refuses)."""
    converted = _converted(_class_of(config), config.to_json_string(use_diff=False), 1, False)
    if not converted.moe_layers:
        return f"{config.model_type} has no mixture-of-experts layer"
    if converted.experts_per_layer % ep_size:
        return f"its {converted.experts_per_layer} experts per layer do not divide over {ep_size} ranks"
    return None


def tp_shared_numels(
    config: PretrainedConfig, tp_size: int, etp_size: int | None = None, ep_size: int = 1
) -> list[int]:
    """Elements of each of one block's replicated parameters applied to one TP rank's heads or tokens only (per-head
    q/k norms; at the experts' TP size 1 the experts, ``1/ep`` of each under EP): each one's gradient is all-reduced
    over TP in backward."""
    one_layer = with_layers(config, 1)
    converted = _converted(_class_of(one_layer), one_layer.to_json_string(use_diff=False), tp_size, False, etp_size)
    return [n // ep_size if expert else n for n, expert in zip(converted.tp_shared, converted.tp_shared_experts)]


def fsdp_traffic(config: PretrainedConfig, tp_size: int, dp_size: int, element_size: int = 4) -> dict[str, Any]:
    """FSDP2's collectives in one step of a TP rank (:mod:`mtk.parallel.fsdp`, one micro-batch, one stage): per
    unit (each decoder layer, then the root) one all-gather for the forward and, but for the root, one for the
    backward, and one reduce-scatter of its gradients. FSDP2 pads each parameter's dim 0 to a multiple of
    ``dp_size`` and moves a unit's parameters in one flat buffer: an all-gather's input is the rank's padded
    pieces, a reduce-scatter's the whole padded unit."""
    units = _units(_class_of(config), config.to_json_string(use_diff=False), tp_size)
    pieces = [sum(-(-shape[0] // dp_size) * _product(shape[1:]) for shape in unit) * element_size for unit in units]
    layers, root = pieces[:-1], pieces[-1]
    return {
        "all_gather": {"count": 2 * len(layers) + 1, "bytes": 2 * sum(layers) + root},
        "reduce_scatter": {"count": len(pieces), "bytes": dp_size * sum(pieces)},
    }


def _product(sizes: tuple[int, ...]) -> int:
    total = 1
    for size in sizes:
        total *= size
    return total


@functools.lru_cache(maxsize=64)
def _units(config_class: Any, config_json: str, tp_size: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The shapes of each FSDP2 unit's own parameters on TP rank 0: the decoder layers, then the root's rest."""
    config = config_class.from_dict(json.loads(config_json))
    with fake_process_group(tp_size), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = meta_model(config, TraceSettings(tp_size), pp_size=1, pp_rank=0)
        layers = sharded_modules(model)
        inside = {id(p) for layer in layers for p in layer.parameters()}
        units = [tuple(tuple(p.shape) for p in layer.parameters()) for layer in layers]
        units.append(tuple(tuple(p.shape) for p in model.parameters() if id(p) not in inside))
    return tuple(units)


def sequence_parallel_elements(config: PretrainedConfig, tp_size: int) -> int:
    """Elements of one block's parameters that sequence parallelism marks (norm weights, row biases: replicated,
    applied to 1/tp of the sequence): what it sums over TP after backward."""
    one_layer = with_layers(config, 1)
    return _converted(_class_of(one_layer), one_layer.to_json_string(use_diff=False), tp_size, True).sequence_parallel


def _class_of(config: PretrainedConfig) -> Any:
    return type(config)  # a hashable cache key (mypy reads PretrainedConfig's __hash__ as an instance method)


@dataclass(frozen=True)
class _Converted:
    """TP rank 0 of the converted model: each parameter's elements (in order) and what they are."""

    numels: tuple[int, ...]
    experts: tuple[bool, ...]  # an MoE layer's 3D expert tensor
    tp_shared: tuple[int, ...]  # the elements of each parameter marked tp_shared
    tp_shared_experts: tuple[bool, ...]  # of those, which are expert tensors (the experts' TP size 1)
    sequence_parallel: int  # elements marked sequence-parallel
    moe_layers: int
    experts_per_layer: int  # E of the first MoE layer (0: none)


@functools.lru_cache(maxsize=64)
def _converted(
    config_class: Any, config_json: str, tp_size: int, sequence_parallel: bool, etp_size: int | None = None
) -> _Converted:
    config = config_class.from_dict(json.loads(config_json))
    settings = TraceSettings(tp_size, sequence_parallel=sequence_parallel, etp_size=etp_size)
    with fake_process_group(tp_size), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes belong to a real run
        model = meta_model(config, settings, pp_size=1, pp_rank=0)
        params = list(model.parameters())
        moe = [m for m in model.modules() if hasattr(m, "num_experts") and hasattr(m, "down_proj")]  # spread_experts'
        experts = {id(p) for m in moe for p in m.parameters(recurse=False)}
    return _Converted(
        numels=tuple(p.numel() for p in params),
        experts=tuple(id(p) in experts for p in params),
        tp_shared=tuple(p.numel() for p in params if param_info(p).tp_shared),
        tp_shared_experts=tuple(id(p) in experts for p in params if param_info(p).tp_shared),
        sequence_parallel=sum(p.numel() for p in params if param_info(p).sequence_parallel),
        moe_layers=len(moe),
        experts_per_layer=int(cast(Any, moe[0]).num_experts) if moe else 0,
    )


def has_residual_dropout(config: PretrainedConfig) -> bool:
    """Whether a residual dropout with p > 0 follows the blocks' row-parallel layers."""
    return any(getattr(config, name, 0) or 0 for name in ("resid_pdrop", "hidden_dropout_prob", "hidden_dropout"))


def data_parallel_traffic(
    config: PretrainedConfig,
    tp_size: int,
    dp_size: int,
    distributed_optimizer: bool = False,
    ep_size: int = 1,
    etp_size: int | None = None,
) -> dict[str, Any]:
    """:func:`~mtk.planner.collectives.predict_collectives`' DP arguments for a one-stage replica: this rank's
    gradient elements and, with the distributed optimizer, the all-gather rounds (the same assignment
    ``shard_optimizer`` makes). With expert parallelism the experts (``1/ep`` of them here) are reduced in calls
    of their own over their ``dp/ep`` replicas (``expert_gradient_numels``; none with one replica), and the
    distributed optimizer's expert rounds run over those replicas too. ``etp_size``: the experts' TP size (1: each
    expert whole on every TP rank)."""

    if dp_size == 1:
        return {}
    numels = local_numels(config, tp_size, etp_size)
    if ep_size > 1:
        flags = expert_flags(config, tp_size, etp_size)
        dense = [n for n, expert in zip(numels, flags) if not expert]
        experts = [n // ep_size for n, expert in zip(numels, flags) if expert]
    else:
        dense, experts = numels, []
    replicas = dp_size // ep_size
    traffic: dict[str, Any] = {"dp_gradient_elements": sum(dense)}
    if experts and replicas > 1:
        traffic["expert_gradient_numels"] = tuple(experts)
    if distributed_optimizer:
        widths = all_gather_widths(dense, dp_size) + (all_gather_widths(experts, replicas) if experts else ())
        traffic["all_gather_widths"] = widths
    return traffic


def all_gather_widths(numels: list[int], replicas: int) -> tuple[int, ...]:
    """Elements each rank contributes per all-gather round of mtk's distributed optimizer over ``replicas`` ranks
    (none over one)."""
    if replicas == 1:
        return ()
    rounds = all_gather_rounds(numels, assign_owners(numels, replicas), replicas)
    return tuple(max(sum(numels[i] for i in p) for p in pieces) for pieces in rounds)
