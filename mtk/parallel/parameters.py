"""What mtk knows about a parameter, in one typed record: :class:`ParamInfo`.

Conversion, the pipeline cut and the parallel layers learn facts about parameters that gradient
norms, gathering, checkpoints and the loaders need later: which TP ranks hold copies of a shard,
which replicated parameter sees only part of the data, which pipeline copy of a tied embedding is a
duplicate. They are kept in one ``ParamInfo`` per parameter (``param.mtk_info``), read with
:func:`param_info` and written with :func:`set_param_info`; :func:`copy_param_info` carries them, and
the Megatron attributes below, to a replacement tensor.

The Megatron attributes DeepSpeed reads (``tensor_model_parallel``, ``partition_dim``,
``partition_stride``) stay plain attributes: that is the protocol DeepSpeed's clipping understands (whether a
parameter is split over TP is :func:`is_tensor_parallel`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "MEGATRON_ATTRIBUTES",
    "ParamInfo",
    "copy_param_info",
    "is_expert_parallel",
    "is_tensor_parallel",
    "mark_tensor_parallel",
    "param_info",
    "set_param_info",
]

MEGATRON_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")
_ATTRIBUTE = "mtk_info"


@dataclass(frozen=True)
class ParamInfo:
    """Facts about one parameter beyond its tensor. The default describes a plain replicated parameter.

    Attributes:
        tp_replicas: TP ranks holding the same shard (kv heads replicated when tp > n_kv): a norm over
            the TP group counts each copy ``1 / tp_replicas``.
        tp_shared: replicated, but applied to one rank's heads only (per-head q/k norms): its gradient
            is summed over TP in backward.
        tp_summed_at_step: a ``tp_shared`` parameter whose gradient is summed over TP once per optimizer step, after
            the last backward, instead (:func:`~mtk.parallel.grads.sum_tp_shared_grads_at_step`).
        sequence_parallel: replicated, but applied to one rank's slice of the sequence (norms, row
            biases under sequence parallelism): its gradient is summed over TP after backward.
        pipeline_tied: a first- or last-stage copy of an embedding tied to the LM head; the copies'
            gradients are summed over the embedding group.
        pipeline_duplicate: the last stage's copy: not counted in norms, not stored by checkpoints.
        tied_to: the HF name the copy is stored under in a one-stage model (the first stage's name).
        expert_parallel: this rank's experts of an MoE layer spread over EP (:mod:`mtk.parallel.expert_parallel`):
            its gradient is reduced over the ranks holding the same experts, and a norm sums it over the EP group.
    """

    tp_replicas: int = 1
    tp_shared: bool = False
    tp_summed_at_step: bool = False
    sequence_parallel: bool = False
    pipeline_tied: bool = False
    pipeline_duplicate: bool = False
    tied_to: str | None = None
    expert_parallel: bool = False


_DEFAULT = ParamInfo()


def param_info(param: torch.Tensor) -> ParamInfo:
    """The record of ``param`` (the default record when mtk never marked it)."""
    return getattr(param, _ATTRIBUTE, _DEFAULT)


def set_param_info(param: torch.Tensor, **changes) -> ParamInfo:
    """Replace fields of ``param``'s record (unknown field names raise ``TypeError``); returns the new record."""
    info = dataclasses.replace(param_info(param), **changes)
    setattr(param, _ATTRIBUTE, info)
    return info


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int) -> None:
    """Tag a sharded parameter the way Megatron and DeepSpeed recognise it."""
    param.tensor_model_parallel = True  # type: ignore[attr-defined]  # DeepSpeed's protocol, not torch's type
    param.partition_dim = partition_dim  # type: ignore[attr-defined]
    param.partition_stride = 1  # type: ignore[attr-defined]


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """A parameter split over TP (each rank holds a slice, or a copy of one: :attr:`ParamInfo.tp_replicas`).

    ``tensor_model_parallel`` is not this question: DeepSpeed reads it as "count this rank's gradient in the
    norm" (a parameter without it counts on TP rank 0 only), so a slice held by several ranks carries it on the
    first of them alone (:class:`~mtk.parallel.layers.KVReplicatedColumnLinear`). ``partition_dim`` is on every copy.
    """
    return hasattr(param, "partition_dim")


def copy_param_info(source: torch.Tensor, target: torch.Tensor) -> None:
    """Give ``target`` (a materialized or loaded replacement) everything mtk and DeepSpeed know of ``source``."""
    if hasattr(source, _ATTRIBUTE):
        setattr(target, _ATTRIBUTE, param_info(source))
    for name in MEGATRON_ATTRIBUTES:
        if hasattr(source, name):
            setattr(target, name, getattr(source, name))


def is_expert_parallel(param: torch.Tensor) -> bool:
    """A parameter holding this rank's experts only (its gradient is reduced over the expert replicas)."""
    return param_info(param).expert_parallel
