"""The true global gradient norm of a model split over TP (and PP) ranks, and clipping by it.

Each model-parallel rank holds a disjoint piece of every sharded parameter, so the squared norms of
sharded gradients are summed over the model-parallel group. A replicated parameter has the same
gradient on every TP rank and is counted on TP rank 0 only. A kv head replicated over ``c`` ranks
(``ParamInfo.tp_replicas``) is counted with weight ``1/c``. Pipeline stages hold disjoint layers (summed over
the PP part of the model-parallel group); the last stage's copy of a tied embedding is not counted.
Data-parallel replicas hold the same, already averaged, gradients: nothing is summed over DP, except where FSDP2
splits a gradient over the DP ranks (:mod:`~mtk.parallel.fsdp`): their disjoint pieces are summed over its shard group,
and where expert parallelism spreads the experts (:mod:`~mtk.parallel.expert_parallel`): each EP rank's experts are
its own, summed over the EP group.
The result is the norm of the unsplit model's gradient, what ``torch.nn.utils.clip_grad_norm_``
would return on one process.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist

from mtk.errors import TrainingError
from mtk.parallel.comm import all_reduce
from mtk.parallel.expert_parallel import is_expert_parallel
from mtk.parallel.fsdp import is_sharded, local
from mtk.parallel.parameters import is_tensor_parallel, param_info
from mtk.parallel.state import ParallelState

__all__ = ["check_finite", "clip_grad_norm_tp_", "grad_norm_tp"]


def _weight(param: torch.Tensor, parallel: ParallelState) -> float:
    info = param_info(param)
    if info.pipeline_duplicate:  # the last stage's copy of a tied embedding
        return 0.0
    if is_tensor_parallel(param):
        return 1.0 / info.tp_replicas
    return 1.0 if parallel.tp_rank == 0 else 0.0


def _sum_dtype(grads: Iterable[torch.Tensor]) -> torch.dtype:
    """fp32, or fp64 where a gradient is (torch's ``clip_grad_norm_`` sums in the gradients' own dtype: an fp64
    model's norm in fp32 would differ from one process's by fp32 rounding)."""
    return torch.float64 if any(grad.dtype == torch.float64 for grad in grads) else torch.float32


def grad_norm_tp(parameters: Iterable[torch.Tensor], parallel: ParallelState, norm_type: float = 2.0) -> torch.Tensor:
    """Global ``norm_type`` norm (2 or inf) of the gradients of ``parameters`` (collective over TP x PP)."""
    parameters = [p for p in parameters if p.grad is not None]
    grads = [(cast(torch.Tensor, p.grad), _weight(p, parallel)) for p in parameters]
    experts = [is_expert_parallel(p) for p in parameters]  # disjoint over the EP group
    device = local(grads[0][0]).device if grads else parallel.device
    # FSDP2 gradients: this rank's piece of its TP shard; the pieces of one shard group are disjoint
    split = next((cast(Any, grad).device_mesh.get_group("dp_shard") for grad, _ in grads if is_sharded(grad)), None)
    if norm_type == math.inf:
        wide = _sum_dtype(grad for grad, _ in grads)
        total = torch.zeros(1, dtype=wide, device=device)
        for grad, _ in grads:
            piece = local(grad).detach()
            if piece.numel():
                total = torch.maximum(total, piece.abs().max().to(wide))
        if split is not None:
            all_reduce(total, split, op=dist.ReduceOp.MAX)
        if parallel.ep_size > 1:
            all_reduce(total, parallel.ep_group, op=dist.ReduceOp.MAX)
        return all_reduce(total, parallel.mp_group, op=dist.ReduceOp.MAX)[0]
    if norm_type != 2.0:
        raise ValueError(f"norm_type must be 2 or inf, got {norm_type}")
    wide = _sum_dtype(grad for grad, _ in grads)
    totals = torch.zeros(3, dtype=wide, device=device)  # [whole on this rank, split over DP, this EP rank's]
    for (grad, weight), expert in zip(grads, experts):
        if weight:
            totals[2 if expert else int(is_sharded(grad))] += weight * local(grad).detach().to(wide).pow(2).sum()
    if split is not None:
        totals[1:2] = all_reduce(totals[1:2].clone(), split)
    if parallel.ep_size > 1:
        totals[2:] = all_reduce(totals[2:].clone(), parallel.ep_group)
    return all_reduce(totals.sum().reshape(1), parallel.mp_group)[0].sqrt()


@torch.no_grad()
def clip_grad_norm_tp_(
    parameters: Iterable[torch.Tensor], max_norm: float, parallel: ParallelState, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; returns the norm before clipping."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = grad_norm_tp(parameters, parallel, norm_type)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for param in parameters:
        grad = local(cast(torch.Tensor, param.grad))  # filtered above
        grad.mul_(coef.to(grad.device))
    return norm


def check_finite(
    value: torch.Tensor | float,
    step: int,
    *,
    what: str = "the gradient norm",
    skip: bool = False,
    remedy: str = "lower --lr, or pass --skip_nonfinite to skip such steps",
) -> bool:
    """Whether the optimizer may step, given ``what`` (the global gradient norm, or a loss) is ``value``.

    A non-finite value stops the run (:class:`TrainingError` naming the step) before a checkpoint with
    non-finite weights can be written, or, with ``skip``, says so and returns ``False`` (the step is
    skipped). The value must be the same on every rank (a global norm, a loss reduced over the job), so
    every rank decides the same.
    """
    number = float(value)
    if math.isfinite(number):
        return True
    if not skip:
        raise TrainingError(f"step {step}: {what} is {number}; stopped before non-finite weights are saved ({remedy})")
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"mtk: step {step} skipped: {what} is {number}", flush=True)
    return False
