"""What expert parallelism adds to a plan: which layouts may spread the experts, the all-to-alls and their time
(``mtk plan --ep``; docs/moe.md). The experts' memory (``1/ep`` of each expert tensor, their optimizer state
sharded over ``dp/ep`` replicas) is the trace's (:class:`~mtk.planner.trace.TraceSettings` ``ep_size``)."""

from __future__ import annotations

from transformers import PretrainedConfig

from mtk.planner.collectives import Predicted, predict_expert_collectives
from mtk.planner.layouts import Candidate, Request
from mtk.planner.shapes import every_layer_moe, expert_parallel_refusal, moe_layers, stage_moe_layers
from mtk.planner.timing import collective_seconds

__all__ = ["expert_collectives", "expert_parallel_sizes", "expert_tp_sizes", "expert_traffic"]


def expert_parallel_sizes(request: Request, c: Candidate) -> list[int]:
    """The EP sizes ``c`` may run: those asked for that divide its DP x CP replicas and the experts, where mtk runs
    EP (init.check_expert_parallel, deepspeed_experts.check_deepspeed_experts): an MoE model under accelerate, or
    under DeepSpeed at ZeRO 1 or 2 without CP, training the experts or their LoRA factors. Not weighed: a pipeline
    unless every decoder layer is an MoE layer (each stage's exchanges are then known), and DeepSpeed's optimizer
    offload next to EP."""
    config = request.config
    deepspeed = (
        c.sharding in ("zero1", "zero2")
        and not c.offload
        and c.cp_size == 1
        and (not request.lora_r or bool(request.lora_target_parameters))
    )
    runs = c.engine == "accelerate" or deepspeed
    if not moe_layers(config) or (c.pp_size > 1 and not every_layer_moe(config)) or not runs:
        return [1] if 1 in request.ep_sizes else []  # as --cp N, --ep N weighs EP N layouts only
    return [ep for ep in request.ep_sizes if c.replica_size % ep == 0 and expert_parallel_refusal(config, ep) is None]


def expert_tp_sizes(request: Request, c: Candidate) -> list[int | None]:
    """The experts' TP sizes ``c`` may run: the TP size (``None``), and 1 where asked for on an MoE model at TP > 1
    under accelerate without a sharded model or CP (checked against runs: under FSDP2 the gradients reduce-scatter
    in backward, under DeepSpeed the whole experts' TP sums stay in backward)."""
    whole = (
        1 in request.etp_sizes
        and c.tp_size > 1
        and moe_layers(request.config) > 0
        and c.engine == "accelerate"
        and c.sharding in ("none", "distopt")
        and c.cp_size == 1  # (whole experts under CP: not held against a run)
        and (c.pp_size == 1 or every_layer_moe(request.config))
    )
    split = None in request.etp_sizes or c.tp_size == 1  # (at TP 1 every expert is whole already)
    return ([None] if split else []) + ([1] if whole else [])


def expert_collectives(request: Request, c: Candidate, element_size: int, stage_layers: int) -> Predicted:
    """The exchange's all-to-alls per step on a rank of a stage of ``stage_layers`` decoder layers (nothing at
    ``ep = 1``)."""
    config: PretrainedConfig = request.config
    tokens = c.micro_batch_size * request.seq // c.cp_size  # a CP rank dispatches its part of each row
    return predict_expert_collectives(
        stage_moe_layers(config, stage_layers, c.pp_size),
        -(-tokens // c.tp_size) if c.etp_size == 1 else tokens,  # whole experts: each TP rank its share
        int(getattr(config, "num_experts_per_tok", 0) or 0),
        config.hidden_size,
        c.ep_size,
        element_size,
        recompute=c.recompute is not None,
        micro_batches=c.micro_batches,
    )


def expert_traffic(exchange: Predicted, ep_size: int, bandwidth: float) -> tuple[int, float]:
    """(bytes, seconds on the EP group's link) of the exchange: all but a rank's own share of each all-to-all
    leaves it (at balanced routing)."""
    nbytes = exchange.nbytes["all_to_all"]
    return nbytes, collective_seconds("all_to_all", nbytes, ep_size, bandwidth)
