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
masks the first forward drew (loss and gradients equal the run without recompute). HF's checkpointing turned on
by the user (``gradient_checkpointing_enable``, before or after the conversion) gets the same context:
:func:`keep_streams_under_checkpointing`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from transformers.modeling_layers import GradientCheckpointingLayer

from mtk.config import RunSettings
from mtk.errors import ConfigError
from mtk.parallel.random import RNGStreams, recompute_context

__all__ = ["enable_recompute", "keep_streams_under_checkpointing", "never_saved", "recomputed_blocks"]

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


def _with_own(streams: RNGStreams, own: Callable[[], tuple]):
    """A caller's ``context_fn`` (a selective policy of its own) run inside the streams' contexts."""
    forward, rerun = recompute_context(streams)
    own_forward, own_rerun = own()
    return _together(forward, own_forward), _together(rerun, own_rerun)


_KEEPS_STREAMS = "_mtk_keeps_streams"  # set on a checkpoint function that restores the streams


def _keeping_streams(function: Callable, streams: RNGStreams, report: Callable[[str], None]) -> Callable:
    """``function`` (HF's ``partial(torch.utils.checkpoint.checkpoint, **kwargs)``) with a ``context_fn`` that also
    restores ``streams``; a reentrant one, which takes no context, runs non-reentrant (said in one line)."""
    keywords = getattr(function, "keywords", {})
    own = keywords.get("context_fn")
    if getattr(function, _KEEPS_STREAMS, False) or (isinstance(own, partial) and own.func is _contexts):
        return function  # mtk's own recompute, or wrapped here already
    if keywords.get("use_reentrant", False):
        report(
            "mtk: activation checkpointing with use_reentrant=True runs non-reentrant: a reentrant checkpoint "
            "cannot restore the tensor-parallel dropout stream for its rerun"
        )
    context = partial(_contexts, streams, False) if own is None else partial(_with_own, streams, own)
    wrapped = partial(function, use_reentrant=False, context_fn=context)
    setattr(wrapped, _KEEPS_STREAMS, True)
    return wrapped


class _KeepingStreams:
    """A model's ``_set_gradient_checkpointing`` that gives every checkpoint function it installs the streams (the
    class's own, or its override, does the rest)."""

    def __init__(self, model: nn.Module, streams: RNGStreams, report: Callable[[str], None]) -> None:
        self.model, self.streams, self.report = model, streams, report

    def __call__(
        self, enable: bool = True, gradient_checkpointing_func: Callable = checkpoint, every_n_layers: int = 1
    ) -> None:
        function = _keeping_streams(gradient_checkpointing_func, self.streams, self.report)
        cast(Any, type(self.model))._set_gradient_checkpointing(
            self.model, enable=enable, gradient_checkpointing_func=function, every_n_layers=every_n_layers
        )


def keep_streams_under_checkpointing(
    model: nn.Module, streams: RNGStreams, report: Callable[[str], None] = lambda line: None
) -> None:
    """HF's activation checkpointing however it is turned on (``gradient_checkpointing_enable`` before the
    conversion or after it, with any keyword arguments) reruns a block with only torch's live generator restored:
    the parked TP stream stood where the forward left it, so the rerun drew other attention-dropout masks than the
    forward and the gradients were not the loss's, without a word. The checkpoint functions the blocks hold, and
    any the model sets later (through its ``_set_gradient_checkpointing``, which every way of turning it on goes
    through), restore the streams as mtk's recompute does."""
    for module in model.modules():
        function = getattr(module, "_gradient_checkpointing_func", None)
        if function is not None:
            cast(Any, module)._gradient_checkpointing_func = _keeping_streams(function, streams, report)
    if hasattr(type(model), "_set_gradient_checkpointing"):
        cast(Any, model)._set_gradient_checkpointing = _KeepingStreams(model, streams, report)


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
