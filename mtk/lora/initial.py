"""Adapters that start where single-process PEFT's start, and full adapter tensors put into this rank's shards.

:class:`~mtk.lora.layers.ParallelLoraLinear` draws each module's factors from a generator of its own, seeded by
``(seed, module name)``: the same adapters at every layout, but not the numbers ``peft.get_peft_model`` draws on
one process, where every module draws in turn from the global generator. A run that must reproduce a
single-process PEFT run (TRL's trainers with ``peft_config``, :mod:`mtk.trainers.adapters`) starts from those:
:func:`peft_initial_adapters` replays PEFT's draws on the full shapes and :func:`load_full_adapters` cuts full
tensors to this rank's shards (by each parameter's :class:`~mtk.parallel.sharding.ShardSpec`, as checkpoints do).

PEFT (0.21, ``LoraLayer.update_layer``) adapts the modules in ``named_modules`` order. For each it builds
``nn.Linear(in, r)`` then ``nn.Linear(r, out)`` (each draws torch's default kaiming-uniform init), then
``reset_lora_parameters``: ``init_lora_weights=True`` redraws ``A`` kaiming-uniform (a = sqrt 5) and zeroes ``B``,
``"gaussian"`` redraws ``A`` from N(0, 1/r^2) and zeroes ``B``, ``False`` keeps both. The factors are then cast to
the base layer's dtype (``autocast_adapter_dtype`` brings half-precision ones back to fp32: the rounding stays).
Which modules it adapts, and each one's rank (``rank_pattern``), PEFT itself says: it adapts a copy of the model
built on the meta device, so no base weight is read or copied, and a pipeline stage knows the modules of the
stages before it (whose draws come first).
"""

from __future__ import annotations

import copy
import math
from typing import Any, cast

import torch
from torch import nn

from mtk.errors import ConfigError
from mtk.models import whole_parameters
from mtk.parallel.expert_parallel import spread_layout
from mtk.parallel.gather import full_shape_and_spec
from mtk.parallel.record import hf_model
from mtk.parallel.sharding import take_shard

__all__ = ["load_full_adapters", "peft_initial_adapters"]


Layer = tuple[str, int, int, int, int]  # (HF module name, in, out, r, experts) of one module PEFT adapts


def _adapted_layers(model: nn.Module, config: Any, adapter_name: str) -> list[Layer]:
    """``(HF module name, in, out, r, experts)`` of every module PEFT adapts in ``model``'s whole HF model, in the
    order PEFT draws them: the ``target_modules`` in ``named_modules`` order, then the ``target_parameters``'
    ``ParamWrapper`` s (``experts``: the tensor's ``E``, each factor ``r·E`` wide), per module in its parameters'
    order (the innermost wrapper of a nested chain first)."""
    import peft
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper

    hf: Any = hf_model(model)
    with torch.device("meta"), whole_parameters():  # (under ZeRO-3's zero.Init it failed initializing a buffer)
        skeleton = type(hf)._from_config(hf.config)
    with torch.random.fork_rng(devices=[]):  # PEFT draws while it builds the copy: not from this run's generator
        adapted = peft.get_peft_model(skeleton, copy.deepcopy(config), adapter_name=adapter_name)
    modules: list[Layer] = []
    chains: list[list[Layer]] = []
    for name, module in hf_model(adapted).named_modules():
        if not isinstance(module, LoraLayer) or adapter_name not in module.r:
            continue
        entry = (name, cast(int, module.in_features), cast(int, module.out_features), module.r[adapter_name])
        if not isinstance(module, ParamWrapper):
            modules.append((*entry, 1))
        elif chains and name == chains[-1][0][0] + ".base_layer":  # wrapped by the one before it: drawn before it
            chains[-1].insert(0, (*entry, module.num_experts))
        else:
            chains.append([(*entry, module.num_experts)])
    return modules + [layer for chain in chains for layer in chain]


def _linear_default(out_features: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """What ``nn.Linear(in_features, out_features, bias=False)`` draws for its weight ``[out, in]``."""
    weight = torch.empty(out_features, in_features)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
    return weight


def _base_dtype(model: nn.Module, name: str) -> torch.dtype | None:
    """The dtype PEFT rounds module ``name``'s factors to: its base weight's (a ``ParamWrapper``'s: the adapted
    tensor's); ``None`` when this rank's stage does not hold it."""
    try:
        module: Any = model.get_submodule(name)
    except AttributeError:
        return None
    if hasattr(module, "get_param") and hasattr(module, "parameter_name"):  # PEFT's ParamWrapper
        return module.get_param().dtype
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    return base.weight.dtype if isinstance(getattr(base, "weight", None), torch.Tensor) else None


def peft_initial_adapters(
    model: nn.Module, config: Any, seed: int, adapter_name: str = "default"
) -> dict[str, torch.Tensor]:
    """The full LoRA factors ``peft.get_peft_model(model, config)`` draws on one process right after
    ``torch.manual_seed(seed)``, by HF parameter name (``...q_proj.lora_A.default.weight``), rounded to each base
    layer's dtype as PEFT rounds them. ``model`` is the HF model (converted or not, or a ``PeftModel``: only its
    class, config and dtypes are read). Touches no generator of the run."""
    init = config.init_lora_weights
    if init not in (True, False, "gaussian"):
        raise ConfigError(f"init_lora_weights={init!r}: PEFT's draws are replayed for True, False and 'gaussian'")
    generator = torch.Generator().manual_seed(seed)
    live = hf_model(model)
    tensors = {}
    for name, in_features, out_features, r, experts in _adapted_layers(model, config, adapter_name):
        lora_a = _linear_default(r * experts, in_features, generator)  # nn.Linear(in, r E)
        lora_b = _linear_default(out_features, r * experts, generator)  # nn.Linear(r E, out)
        if init is True:
            nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5), generator=generator)
            lora_b.zero_()
        elif init == "gaussian":
            nn.init.normal_(lora_a, std=1 / r, generator=generator)
            lora_b.zero_()
        dtype = _base_dtype(live, name)
        for factor, tensor in (("lora_A", lora_a), ("lora_B", lora_b)):
            tensors[f"{name}.{factor}.{adapter_name}.weight"] = tensor if dtype is None else tensor.to(dtype)
    return tensors


def load_full_adapters(model: nn.Module, tensors: dict[str, torch.Tensor], adapter_name: str = "default") -> int:
    """Copy full adapter tensors (HF parameter names, as :func:`peft_initial_adapters` returns them or a PEFT
    adapter file holds them without its ``base_model.model.`` prefix) into this rank's shards of adapter
    ``adapter_name``; returns how many were copied. Every LoRA factor of that adapter on this rank must be
    given (one line naming the first that is not); names it does not hold (another stage's) are skipped.
    Local: no collective."""
    hf: Any = hf_model(model)
    params = dict(hf.named_parameters())
    marks = (f".lora_A.{adapter_name}.", f".lora_B.{adapter_name}.")
    wanted = [name for name in params if any(mark in name for mark in marks)]
    missing = [name for name in wanted if name not in tensors]
    if not wanted or missing:
        first = missing[0] if missing else f"a LoRA factor of adapter {adapter_name!r}"
        raise ConfigError(f"full adapters: {first} is not among the {len(tensors)} tensors given")
    for name in wanted:
        full = tensors[name]
        shape, spec = full_shape_and_spec(hf, name)
        if tuple(full.shape) != tuple(shape):
            raise ConfigError(f"full adapters: {name} is {tuple(full.shape)}, the model's is {tuple(shape)}")
        param = cast(torch.Tensor, params[name])
        value = take_shard(spec, shape, full.__getitem__)
        layout = spread_layout(hf, name)  # the experts' factors spread with them: this rank's experts' part
        with torch.no_grad():
            param.copy_(layout.own(value) if layout is not None else value)
    return len(wanted)
