"""Activation recomputation per transformer block, through HF's own activation checkpointing.

HF's blocks (``GradientCheckpointingLayer``) checkpoint their ``forward`` when the model's
``activation_checkpointing_enable`` turned them on; mtk chooses which blocks and what they keep, as
Megatron's options say (Korthikanti et al., 2022):

- ``full``: a chosen block keeps only its input and reruns its whole forward in backward (its TP
  collectives too). ``uniform`` chooses every block of the stage, ``block`` the first
  ``recompute_num_layers`` of each stage (the later ones finish their backward first, so the earliest
  activations wait longest: those are the ones worth dropping).
- ``selective``: every block keeps the outputs of its matmuls and reruns only the cheap, memory-hungry
  rest (norms, activation functions, softmax, dropout), via torch's selective checkpointing.

Dropout stays exact: torch restores the live generator for the rerun, and
:func:`~mtk.parallel.random.recompute_context` restores the parked TP stream, so the rerun draws the
masks the first forward drew (loss and gradients equal the run without recompute).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers.modeling_layers import GradientCheckpointingLayer

from mtk.config import RunSettings
from mtk.errors import ConfigError
from mtk.parallel.random import RNGStreams, recompute_context

__all__ = ["enable_recompute", "never_saved", "recomputed_blocks"]

# Kept under selective recompute: the FLOP-heavy products (everything else is rerun).
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


_UNSAVED = threading.local()  # depth of never_saved() blocks on this thread


@contextlib.contextmanager
def never_saved() -> Iterator[None]:
    """Selective recompute keeps no product computed inside: code whose autograd function saves what its own
    backward needs (context-parallel attention) would only have its temporaries kept twice, and mutates them."""
    _UNSAVED.depth = getattr(_UNSAVED, "depth", 0) + 1
    try:
        yield
    finally:
        _UNSAVED.depth -= 1


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in _SAVED_OPS and not getattr(_UNSAVED, "depth", 0):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@contextlib.contextmanager
def _together(*contexts: contextlib.AbstractContextManager) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def _contexts(streams: RNGStreams | None, selective: bool):
    """``context_fn`` for ``torch.utils.checkpoint``: (forward context, recompute context)."""
    forward, rerun = recompute_context(streams) if streams is not None else (contextlib.nullcontext(),) * 2
    if not selective:
        return forward, rerun
    keep_forward, keep_rerun = create_selective_checkpoint_contexts(_keep_matmuls)
    return _together(forward, keep_forward), _together(rerun, keep_rerun)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """This stage's checkpointable blocks, in order (another stage's are pass-throughs, not blocks)."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def recomputed_blocks(model: nn.Module) -> list[int]:
    """Positions (among this stage's blocks) of the blocks that recompute."""
    return [i for i, block in enumerate(_blocks(model)) if block.gradient_checkpointing]


def enable_recompute(model: nn.Module, settings: RunSettings, streams: RNGStreams | None = None) -> list[str]:
    """Turn on the recompute ``settings`` ask for (no-op when off); returns lines to report.

    ``model`` is the HF model (this rank's stage of it); ``streams`` its random streams
    (``parallelized(model).rng``) when it was converted.
    """
    granularity = settings.recompute
    if granularity is None:
        return []
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(
            f"activation recomputation: {type(model).__name__} does not support HF's activation checkpointing; "
            "turn megatron_lm_recompute_activations / --gradient_checkpointing off for this model"
        )
    selective = granularity == "selective"
    enable = cast(Any, model).activation_checkpointing_enable
    if "gradient_checkpointing_enable" in vars(model) and hasattr(model, "_activation_checkpointing_enable"):
        # the model's own, past a wrapper set on the instance that replaces the context_fn (TRL's selective
        # checkpointing in SFTTrainer): mtk's context restores the tensor-parallel dropout stream
        enable = cast(Any, model)._activation_checkpointing_enable
    enable(
        activation_checkpointing_kwargs={"use_reentrant": False, "context_fn": partial(_contexts, streams, selective)}
    )
    blocks = _blocks(model)
    notes = []
    if not selective and settings.recompute_method == "block":
        for index, block in enumerate(blocks):
            cast(Any, block).gradient_checkpointing = index < settings.recompute_num_layers
    elif not selective and settings.recompute_num_layers > 1:
        notes.append(
            f"mtk: recompute_method=uniform with recompute_num_layers={settings.recompute_num_layers}: mtk reruns "
            "every block, checkpointing HF's blocks one at a time (Megatron groups them: the same recompute, "
            "a few more block inputs kept)"
        )
    return notes
