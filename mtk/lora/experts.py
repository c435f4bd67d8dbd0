"""PEFT's LoRA on 3D expert tensors (``target_parameters``) next to expert parallelism.

PEFT's ``ParamWrapper`` adapts a parameter of ``E`` experts with two factors that hold every expert:
``lora_A [r·E, in]`` (expert-major rows) and ``lora_B [out, r·E]`` (the expert index fastest), drawn at the
shape of the tensor it wraps. Under EP that tensor is this rank's ``E/ep`` experts, so PEFT alone would draw
factors of another shape and other numbers at every EP size. mtk keeps the factors whole on every rank, as one
process holds them (they are small: ``r·E·(in + out)`` per tensor), and each rank applies the rows and columns of
its own experts (:class:`SpreadExpertsLora`).

Whole factors are replicated parameters like any other. A rank's gradient of them is non-zero in its experts' part
only: there, the sum over its EP group's tokens routed to those experts. Averaged over the DP x CP replicas as DDP
averages every replicated gradient, each expert's part becomes the sum over the EP groups divided by DP x CP, which
is what the spread experts' own reduction computes (:func:`~mtk.parallel.expert_parallel.reduce_expert_gradients`)
and what one process computes on the global batch. So DDP, clipping, the distributed optimizer, checkpoints (whole
tensors, resumable at any EP size) and PEFT's adapter files need nothing of their own.

Every ``ParamWrapper`` mtk's :func:`~mtk.lora.get_peft_model` builds draws its factors from a generator of its own,
seeded by the run's seed and the parameter's HF name (as :class:`~mtk.lora.layers.ParallelLoraLinear` does): the
same adapters at every EP size.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from mtk.errors import ConfigError
from mtk.lora.layers import adapter_seed, full_factors
from mtk.parallel.expert_parallel import expert_placement

__all__ = ["SpreadExpertsLora", "use_whole_expert_factors"]


class SpreadExpertsLora:
    """Mixed into PEFT's ``ParamWrapper`` of a spread experts tensor: whole factors (``num_experts`` = all ``E``),
    the delta of this rank's experts ``[first, stop)`` only."""

    mtk_experts: tuple[int, int]

    def get_delta_factors(self, adapter_name: str) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``(lhs, rhs, scaling)`` of this rank's experts: ``[E/ep, ., .]`` each (PEFT's of all ``E``, cut)."""
        self._check_whole(adapter_name)
        lhs, rhs, scaling = cast(Any, super()).get_delta_factors(adapter_name)  # [E, ., .] each
        first, stop = self.mtk_experts
        return lhs[first:stop], rhs[first:stop], scaling

    def get_delta_weight(self, adapter_name: str, *args: Any, **kwargs: Any) -> torch.Tensor:
        """This rank's experts' delta ``[E/ep, ., .]`` in the layout of the tensor it is added to, computed as PEFT
        computes the whole one (in the factors' dtype, then cast)."""
        this = cast(Any, self)
        self._check_whole(adapter_name)
        first, stop = self.mtk_experts
        weight_a = this.lora_A[adapter_name].weight
        weight_b = this.lora_B[adapter_name].weight
        weight_a = weight_a.reshape(this.num_experts, -1, weight_a.shape[-1])[first:stop]  # [E/ep, r, in]
        weight_b = weight_b.reshape(weight_b.shape[0], -1, this.num_experts)[..., first:stop]  # [out, r, E/ep]
        layout = "o r e, e r i -> e o i" if this._did_swap_in_out_features else "o r e, e r i -> e i o"
        delta = torch.einsum(layout, weight_b, weight_a) * this.scaling[adapter_name]
        param = this.get_param()
        return delta.to(param.device, param.dtype) if param.dtype.is_floating_point else delta.to(param.device)

    def _check_whole(self, adapter_name: str) -> None:
        this = cast(Any, self)
        rows = this.lora_A[adapter_name].weight.shape[0]
        if rows != this.r[adapter_name] * this.num_experts:
            raise ConfigError(
                f"LoRA adapter {adapter_name!r} on {this.parameter_name} holds {rows} rows for {this.num_experts} "
                "spread experts: add every adapter through mtk.lora.get_peft_model (PEFT's add_adapter draws them "
                "at this rank's experts only)"
            )


_SPREAD_CLASSES: dict[type, type] = {}


def _spread_class(base: type) -> type:
    """``base`` (PEFT's ParamWrapper) with :class:`SpreadExpertsLora` before it, one class per base."""
    if base not in _SPREAD_CLASSES:
        _SPREAD_CLASSES[base] = type(f"Spread{base.__name__}", (SpreadExpertsLora, base), {})
    return _SPREAD_CLASSES[base]


def use_whole_expert_factors(model: nn.Module, adapter_name: str, init: Any, seed: int) -> int:
    """Give every ``ParamWrapper`` of ``model`` (a ``PeftModel``) whole factors drawn from its own generator
    (``init``: ``LoraConfig.init_lora_weights``), and make those on a tensor EP spread apply this rank's experts'
    part (:class:`SpreadExpertsLora`); returns how many were spread."""
    from peft.tuners.lora.layer import ParamWrapper

    spread = 0
    for name, found in model.named_modules():
        if not isinstance(found, ParamWrapper) or adapter_name not in found.lora_A:
            continue
        wrapper: Any = found
        placement = expert_placement(wrapper.get_base_layer())
        experts = placement.num_experts if placement is not None else wrapper.num_experts
        r = wrapper.r[adapter_name]
        generator = torch.Generator().manual_seed(adapter_seed(seed, _hf_name(name, wrapper.parameter_name)))
        a, b = full_factors(r * experts, wrapper.in_features, wrapper.out_features, init, generator, rank=r)
        for factor, value in ((wrapper.lora_A[adapter_name], a), (wrapper.lora_B[adapter_name], b)):
            old = factor.weight
            factor.weight = nn.Parameter(value.to(old.device, old.dtype), requires_grad=old.requires_grad)
        wrapper.lora_A[adapter_name].out_features = wrapper.lora_B[adapter_name].in_features = r * experts
        if placement is not None:
            wrapper.num_experts = experts
            wrapper.mtk_experts = (placement.first, placement.first + placement.local)
            wrapper.__class__ = _spread_class(type(wrapper))
            spread += 1
    return spread


def _hf_name(module_name: str, parameter: str) -> str:
    """``base_model.model.model.layers.0.mlp.experts.base_layer`` + ``gate_up_proj`` ->
    ``model.layers.0.mlp.experts.gate_up_proj``: the adapted tensor's name in the HF model, at any wrapping."""
    parts = [p for p in module_name.split(".") if p != "base_layer"]
    while parts[:2] == ["base_model", "model"]:
        parts = parts[2:]
    return ".".join([*parts, parameter])
