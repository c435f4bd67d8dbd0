"""The conversion ``mtk.Accelerator.prepare`` (or ``parallelize``) does, and what it means for optimizers.

accelerate scripts build the optimizer on the HF model's parameters before ``prepare``; converting the
model replaces them by shards (or drops them: another pipeline stage's). :func:`convert_tracking` records
each replaced parameter (by id, with a weak reference so a reused id is not mistaken for it) and
:func:`repoint` moves an optimizer's groups onto the replacements.
"""

from __future__ import annotations

import weakref
from typing import Any, cast

import torch
from torch import nn

from mtk.config import RunSettings
from mtk.convert import parallelize
from mtk.errors import ConfigError
from mtk.models import num_layers
from mtk.parallel.state import ParallelState
from mtk.pipeline.balance import asked_layers

__all__ = ["ReplacedParams", "convert_tracking", "repoint"]

# id(unconverted parameter) -> (a weak reference to it, its replacement; None when another stage owns it)
ReplacedParams = dict[int, tuple[weakref.ref, "nn.Parameter | None"]]


def convert_tracking(model: nn.Module, parallel: ParallelState, settings: RunSettings) -> ReplacedParams:
    """:func:`~mtk.convert.parallelize` with the run's settings (in place); returns the replaced parameters."""
    before: dict[int, tuple[weakref.ref, list[str]]] = {}  # a tied parameter has several names
    for name, param in model.named_parameters(remove_duplicate=False):
        before.setdefault(id(param), (weakref.ref(param), []))[1].append(name)
    layers = asked_layers(settings, num_layers(cast(Any, model).config), parallel.pp_size)
    sequence_parallel = settings.sequence_parallel and parallel.tp_size > 1
    virtual_stages = settings.virtual_stages if parallel.pp_size > 1 else 1
    parallelize(
        model,
        parallel,
        pipeline_layers=layers,
        virtual_stages=virtual_stages,
        sequence_parallel=sequence_parallel,
        loss_chunk_tokens=settings.loss_chunk_tokens,
    )
    after = dict(model.named_parameters(remove_duplicate=False))
    return {old: (ref, next((after[n] for n in names if n in after), None)) for old, (ref, names) in before.items()}


def _replacement(replaced: ReplacedParams, param: nn.Parameter) -> nn.Parameter | None:
    ref, new = replaced.get(id(param), (None, param))
    return new if ref is None or ref() is param else param  # an id reused by another tensor is not a match


def repoint(optimizer: torch.optim.Optimizer, replaced: ReplacedParams) -> None:
    """Point ``optimizer``'s groups at the converted parameters (in place); refused once it has state."""
    if all(_replacement(replaced, p) is p for g in optimizer.param_groups for p in g["params"]):
        return
    if optimizer.state:
        raise ConfigError("the optimizer already has state; prepare it before its first step")
    for group in optimizer.param_groups:
        group["params"] = [new for p in group["params"] if (new := _replacement(replaced, p)) is not None]
