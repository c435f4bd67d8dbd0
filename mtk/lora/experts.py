"""PEFT's LoRA on 3D expert tensors (``target_parameters``) next to expert and tensor parallelism.

PEFT's ``ParamWrapper`` adapts a parameter of ``E`` experts with two factors that hold every expert:
``lora_A [r·E, in]`` (expert-major rows) and ``lora_B [out, r·E]`` (the expert index fastest), drawn at the
shape of the tensor it wraps. Under EP that tensor is this rank's ``E/ep`` experts, under TP its slice of each
expert's intermediate width, so PEFT alone would draw factors of another shape and other numbers at every layout.
mtk draws the factors of every expert as one process does, then keeps those of this rank's experts: they are
spread with their experts (``lora_A [r·E/ep, in]``, ``lora_B [out, r·E/ep]``, PEFT's layout at ``E/ep`` experts;
an :class:`~mtk.parallel.expert_parallel.ExpertLayout` says where each expert sits in them). Each expert's factors
stay whole over TP, and each rank applies the part its slice of the tensor needs (:class:`LocalExpertsLora`): the
rows (``gate_up_proj``'s gate and up halves) or columns (``down_proj``'s) of its TP slice.

Spread factors are expert parameters, as the experts are: a rank's gradient of them is the sum over its EP group's
tokens routed to its experts, reduced over the ranks holding the same experts and divided by DP x CP
(:func:`~mtk.parallel.expert_parallel.reduce_expert_gradients`), which is what one process computes on the global
batch; clipping counts them once over EP, the distributed optimizer shards their state over the expert replicas,
FSDP2 leaves them whole, and checkpoints store them by global expert (``lora_A``'s rows of each EP rank as its
piece; ``lora_B``, whose columns interleave the experts, gathered and written whole by EP rank 0: it is ``r`` rows
of each expert beside the expert's ``in x out`` numbers). Over TP each rank's gradient is its slice's contribution
(the factor on the split side gets its rows or columns, the other one a partial sum), so it is summed over TP
(:func:`~mtk.parallel.grads.sum_grad_over_tp`, as for per-head q/k norms: once per step under accelerate). With the
experts whole on each TP rank (the experts' TP size 1, :mod:`mtk.parallel.expert_tokens`) each rank's gradient is
its share of the tokens', summed over TP the same way.

Every ``ParamWrapper`` mtk's :func:`~mtk.lora.get_peft_model` builds draws its factors from a generator of its own,
seeded by the run's seed and the adapted tensor's HF name (as :class:`~mtk.lora.layers.ParallelLoraLinear` does):
the same adapters at every layout.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from mtk.errors import ConfigError
from mtk.lora.layers import INITS, adapter_seed, full_factors
from mtk.parallel.comm import group_size
from mtk.parallel.expert_parallel import LAYOUT_ATTRIBUTE, ExpertLayout, expert_placement
from mtk.parallel.expert_tokens import TOKENS_TP_GROUP_ATTRIBUTE
from mtk.parallel.experts import SPECS_ATTRIBUTE, TP_GROUP_ATTRIBUTE
from mtk.parallel.grads import sum_grad_over_tp
from mtk.parallel.parameters import set_param_info
from mtk.parallel.sharding import REPLICATED

__all__ = ["LocalExpertsLora", "draw_expert_factors"]


class LocalExpertsLora:
    """Mixed into PEFT's ``ParamWrapper`` of an experts tensor EP spread or TP split: factors of this rank's experts
    (``num_experts`` its own count), each expert's whole (``in_features``, ``out_features`` of the whole tensor),
    the delta of this rank's piece only.

    Attributes:
        mtk_tp_cut: ``(dim, ranges)`` of the tensor's TP slice (dim 1 or 2 of ``[E, ., .]``), or ``None``.
        mtk_adapters: the adapters whose factors mtk drew.
    """

    mtk_tp_cut: tuple[int, tuple[tuple[int, int], ...]] | None
    mtk_adapters: set[str]  # the adapters whose factors mtk drew (whole, then this rank's experts' part)

    def _local_factors(self, adapter_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``lhs [E', d1', r]`` and ``rhs [E', r, d2']`` in the factors' dtype, ``lhs @ rhs`` this rank's piece
        ``[E', d1', d2']`` of the tensor's delta (before scaling), as PEFT orients them for the whole tensor."""
        this = cast(Any, self)
        if adapter_name not in self.mtk_adapters:
            raise ConfigError(
                f"LoRA adapter {adapter_name!r} on {this.parameter_name} was not added through "
                "mtk.lora.get_peft_model: PEFT's add_adapter draws its factors at this rank's piece of the experts, "
                "other numbers on every rank; train the adapter mtk.lora.get_peft_model made (one per model)"
            )
        weight_a = this.lora_A[adapter_name].weight
        weight_b = this.lora_B[adapter_name].weight
        weight_a = weight_a.reshape(this.num_experts, -1, weight_a.shape[-1])  # [E', r, in]
        weight_b = weight_b.reshape(weight_b.shape[0], -1, this.num_experts).permute(2, 0, 1)  # [E', out, r]
        if this._did_swap_in_out_features:  # the tensor is [E, out, in]
            lhs, rhs = weight_b, weight_a
        else:  # [E, in, out]
            lhs, rhs = weight_a.transpose(-2, -1), weight_b.transpose(-2, -1)
        if self.mtk_tp_cut is not None:
            dim, ranges = self.mtk_tp_cut
            if dim == 1:
                lhs = torch.cat([lhs[:, start:stop] for start, stop in ranges], dim=1)
            else:
                rhs = torch.cat([rhs[:, :, start:stop] for start, stop in ranges], dim=2)
        return lhs, rhs

    def get_delta_factors(self, adapter_name: str) -> tuple[torch.Tensor, torch.Tensor, float]:
        """PEFT's ``(lhs, rhs, scaling)`` of this rank's piece, in the tensor's dtype."""
        lhs, rhs = self._local_factors(adapter_name)
        dtype = cast(Any, self).get_param().dtype
        return lhs.to(dtype), rhs.to(dtype), cast(Any, self).scaling[adapter_name]

    def get_delta_weight(self, adapter_name: str, *args: Any, **kwargs: Any) -> torch.Tensor:
        """This rank's piece of the delta, computed in the factors' dtype and cast as PEFT casts the whole one."""
        lhs, rhs = self._local_factors(adapter_name)
        delta = torch.bmm(lhs, rhs) * cast(Any, self).scaling[adapter_name]
        param = cast(Any, self).get_param()
        return delta.to(param.device, param.dtype) if param.dtype.is_floating_point else delta.to(param.device)


_LOCAL_CLASSES: dict[type, type] = {}


def _local_class(base: type) -> type:
    """``base`` (PEFT's ParamWrapper) with :class:`LocalExpertsLora` before it, one class per base. It keeps the
    base's name: PEFT finds an existing wrapper by its class name (``add_adapter``, nested wrappers)."""
    if base not in _LOCAL_CLASSES:
        _LOCAL_CLASSES[base] = type(base.__name__, (LocalExpertsLora, base), {})
    return _LOCAL_CLASSES[base]


def draw_expert_factors(model: nn.Module, adapter_name: str, init: Any, seed: int) -> int:
    """Give every ``ParamWrapper`` of ``model`` (a ``PeftModel``) the factors one process draws, from a generator of
    its own (``init``: ``LoraConfig.init_lora_weights``); on a tensor EP spread, those of this rank's experts
    (spread with them); on one EP spread or TP split, applied to this rank's piece (:class:`LocalExpertsLora`),
    their gradients summed over TP. Returns how many apply a piece."""
    from peft.tuners.lora.layer import ParamWrapper

    if init not in INITS:
        raise ConfigError(
            f"init_lora_weights={init!r} needs the whole base tensor; LoRA on expert tensors (target_parameters) "
            f"takes one of {list(INITS)}"
        )
    cut = 0
    for name, found in model.named_modules():
        if not isinstance(found, ParamWrapper) or adapter_name not in found.lora_A:
            continue
        wrapper: Any = found
        base = wrapper.get_base_layer()
        placement = expert_placement(base)
        tp_group = getattr(base, TP_GROUP_ATTRIBUTE, None)
        tokens_group = getattr(base, TOKENS_TP_GROUP_ATTRIBUTE, None)  # the experts' TP size 1: tokens split over TP
        full_shape, spec = getattr(base, SPECS_ATTRIBUTE, {}).get(wrapper.parameter_name, (None, None))
        tp_cut = None
        if spec is not None and not spec.is_replicated and group_size(tp_group) > 1:
            tp_cut = (cast(int, spec.dim), spec.ranges)  # 1 or 2 of [E, ., .]
        experts = placement.num_experts if placement is not None else wrapper.num_experts
        if full_shape is not None:  # the whole tensor's in and out, as PEFT reads them from its shape
            wrapper.in_features, wrapper.out_features = (
                (full_shape[2], full_shape[1]) if wrapper._did_swap_in_out_features else full_shape[1:]
            )
        r = wrapper.r[adapter_name]
        rows, tensor = r * experts, wrapper.get_param()
        if tensor.device.type == "meta":  # a plan's trace: shapes only
            a = torch.empty(rows, wrapper.in_features, device="meta")
            b = torch.empty(wrapper.out_features, rows, device="meta")
        else:  # rounded to the tensor's dtype, as PEFT rounds the factors it draws (then keeps them in fp32)
            generator = torch.Generator().manual_seed(adapter_seed(seed, _hf_name(name, wrapper.parameter_name)))
            a, b = full_factors(rows, wrapper.in_features, wrapper.out_features, init, generator, rank=r)
            a, b = a.to(tensor.dtype), b.to(tensor.dtype)
        layouts: tuple[ExpertLayout | None, ExpertLayout | None] = (None, None)
        if placement is not None:  # spread with the experts: A's rows (expert-major), B's columns (expert fastest)
            layouts = (ExpertLayout(placement, dim=0, inner=r), ExpertLayout(placement, dim=1, outer=r))
        factors = (wrapper.lora_A[adapter_name], wrapper.lora_B[adapter_name])
        for factor, value, layout in zip(factors, (a, b), layouts):
            old = factor.weight
            whole_shape = tuple(value.shape)
            if layout is not None:
                value = layout.own(value).clone()  # [r E/ep, in] or [out, r E/ep] (not a view of the whole)
            factor.weight = nn.Parameter(value.to(old.device, old.dtype), requires_grad=old.requires_grad)
            factor.in_features, factor.out_features = value.shape[1], value.shape[0]
            if layout is not None:  # reduced over the expert replicas, counted once over EP, saved by global index
                set_param_info(factor.weight, expert_parallel=True)
                setattr(factor.weight, LAYOUT_ATTRIBUTE, layout)
                setattr(factor, SPECS_ATTRIBUTE, {"weight": (whole_shape, REPLICATED)})
            if tp_cut is not None:  # each TP rank's gradient is its slice's contribution: summed over TP
                sum_grad_over_tp(factor.weight, tp_group)
            elif group_size(tokens_group) > 1:  # whole experts, each TP rank its share of the tokens: summed alike
                sum_grad_over_tp(factor.weight, tokens_group)
        if placement is not None or tp_cut is not None:
            wrapper.num_experts = placement.local if placement is not None else experts
            wrapper.mtk_tp_cut = tp_cut
            wrapper.mtk_adapters = {*getattr(wrapper, "mtk_adapters", ()), adapter_name}
            if not isinstance(wrapper, LocalExpertsLora):
                wrapper.__class__ = _local_class(type(wrapper))
            cut += 1
    return cut


def _hf_name(module_name: str, parameter: str) -> str:
    """``base_model.model.model.layers.0.mlp.experts.base_layer`` + ``gate_up_proj`` ->
    ``model.layers.0.mlp.experts.gate_up_proj``: the adapted tensor's name in the HF model, at any wrapping."""
    parts = [p for p in module_name.split(".") if p != "base_layer"]
    while parts[:2] == ["base_model", "model"]:
        parts = parts[2:]
    return ".".join([*parts, parameter])
