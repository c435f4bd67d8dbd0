"""Where activations are split, and which random stream each dropout draws from, in a converted model.

Two regions of a transformer block are not the plain replicated ones the rules leave behind:

- **Sequence parallelism** (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large
  Transformer Models", section 4.2.2). Between the TP blocks (attention, MLP) the norms, dropouts and
  residual additions run on ``s / tp`` positions per rank instead of all ``s`` on every rank. The
  first block of this stage keeps its rank's chunk of the sequence (no communication forward,
  all-gather backward); the shared-input hooks all-gather it in front of the columns (backward:
  reduce-scatter) and the rows reduce-scatter (backward: all-gather), so one all-reduce per TP block
  becomes an all-gather plus a reduce-scatter of the same total volume. The last block's output is
  all-gathered back for the replicated code after it (the final norm and head; backward: keep the
  own chunk). HF's forward computes positions, rotary embeddings and masks for the whole sequence
  before the first block and the attention sees the whole sequence, so nothing of HF's is rewritten.
  Replicated parameters inside the blocks (norm weights, row biases) then see only this rank's
  positions: they are marked ``sequence_parallel`` and their gradients summed over TP after backward.
- **Random streams** (Megatron's RNG tracker, :mod:`mtk.parallel.random`). A random draw on TP-split
  activations (attention dropout on this rank's heads; under sequence parallelism, everything inside
  a block) takes the per-TP-rank stream; a draw on replicated activations the shared default stream,
  so replicas stay equal. A residual dropout inside an attention module (GPT-2's) forks back to the
  default stream when its input is replicated.
"""

from __future__ import annotations

import inspect
from typing import Any, cast

import torch
from torch import nn
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from mtk.convert.whole_outputs import attach_whole_outputs
from mtk.errors import ConfigError
from mtk.parallel.comm import Group, gather_from_sequence, group_size, scatter_to_sequence
from mtk.parallel.parameters import is_tensor_parallel, param_info, set_param_info
from mtk.parallel.random import DEFAULT_STREAM, TP_SEED_OFFSET, TP_STREAM, ForkAround, RNGStreams
from mtk.parallel.recompute import keep_streams_under_checkpointing
from mtk.parallel.sequence_padding import (
    carries_cache,
    keep_logits,
    named_arguments,
    pad_batch,
    pop_logits_to_keep,
    row_inputs,
    trim_output,
)
from mtk.parallel.state import ParallelState
from mtk.pipeline.stages import SkipLayer
from mtk.rules.base import RuleSet, UnsupportedModelError, compile_pattern

__all__ = ["local_blocks", "apply_regions", "reseed_tp_stream", "tp_streams"]


def tp_streams(parallel: ParallelState) -> RNGStreams:
    """The default stream plus a per-TP-rank one seeded from the user's seed (``torch.initial_seed()``,
    what ``set_seed`` set), so the same seed gives the same masks at every run. ``mtk.Accelerator`` first
    gives every rank of a replica its source rank's generators (:func:`~mtk.parallel.consistency.agree_rng`),
    so a per-process seed (``set_seed(seed, device_specific=True)``) draws what a common one would."""
    streams = RNGStreams(parallel.device)
    streams.add(TP_STREAM, _tp_seed(parallel))
    return streams


def reseed_tp_stream(streams: RNGStreams, parallel: ParallelState) -> None:
    """Seed an existing TP stream again from today's ``torch.initial_seed()`` (a model converted before the
    replica's ranks agreed on their generators, e.g. by ``load_pretrained_tp``)."""
    streams.reseed(TP_STREAM, _tp_seed(parallel))


def _tp_seed(parallel: ParallelState) -> int:
    return torch.initial_seed() + TP_SEED_OFFSET + parallel.tp_rank


def local_blocks(model: nn.Module, rule_set: RuleSet) -> list[nn.Module]:
    """The transformer blocks this rank runs (another pipeline stage's are pass-throughs)."""
    if rule_set.blocks is None:
        return []
    regex = compile_pattern(rule_set.blocks)
    lists = [m for n, m in model.named_modules() if n and regex.match(n) and isinstance(m, nn.ModuleList)]
    if len(lists) != 1:
        return []
    return [block for block in cast(nn.ModuleList, lists[0]) if not isinstance(block, SkipLayer)]


class _SplitSequence:
    """Pre-hook of the stage's first block: keep this rank's chunk of the sequence."""

    def __init__(self, tp_group: Group) -> None:
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (self._split(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._split(kwargs["hidden_states"])}

    def _split(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[1] % self.tp_size:
            raise ConfigError(
                f"sequence parallelism splits the sequence over tp = {self.tp_size} ranks, but this batch has "
                f"{hidden.shape[1]} positions; pad batches to a multiple of {self.tp_size} (mtk's data does when "
                "sequence parallelism is on) or turn megatron_lm_sequence_parallelism off"
            )
        return scatter_to_sequence(hidden, self.tp_group)  # [b, s, h] -> [b, s/tp, h]


class _PadSequence:
    """Pre- and post-hook of the whole model under sequence parallelism: a batch whose length does not divide by
    the TP size is padded at the end (masked, ignored labels) and the padding removed from the output
    (:mod:`mtk.parallel.sequence_padding`)."""

    def __init__(self, model: nn.Module, tp_size: int) -> None:
        self.tp_size = tp_size
        self.signature = inspect.signature(model.forward)
        config = getattr(model, "config", None)
        self.pad_token_id = getattr(config, "pad_token_id", None)
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.causal = type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
        # (positions added, padded length, the caller's logits_to_keep) per forward in progress
        self._added: list[tuple[int, int, int | torch.Tensor]] = []

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # positional (model(ids)): by name, as pad_batch reads them
        inputs = named_arguments(self.signature, args, kwargs) if args else dict(kwargs)
        if carries_cache(inputs):  # (its 1-token steps padded: the pads' keys and values went into the cache)
            raise ConfigError(
                f"{type(module).__name__} runs with sequence parallelism, which cuts each call's tokens over the TP "
                "ranks; a call with a KV cache (generate's) cannot be cut: generate with use_cache=False, or turn "
                "sequence parallelism off"
            )
        kept = pop_logits_to_keep(inputs)  # (of the caller's positions: a mask [b, s] is not padded)
        padded, extra = pad_batch(inputs, self.tp_size, self.pad_token_id, self.max_positions, self.causal)
        if not extra:  # (the call as it came: the model keeps its own positions)
            self._added.append((0, 0, 0))
            return args, kwargs
        # (trimmed by name: the call returns a ModelOutput, the caller's tuple made after, mtk.convert.whole_outputs)
        self._added.append((extra, row_inputs(padded).shape[1], kept))
        return (), padded

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not self._added:  # (an earlier pre-hook refused the call: this one never ran)
            return output
        extra, padded_length, kept = self._added.pop()
        cache: Any = getattr(output, "cache", None) if extra else None
        if hasattr(cache, "crop") and cache.get_seq_length() == padded_length:  # (the pads' keys and values out)
            try:
                cache.crop(-extra)  # (a negative count removes that many)
            except (RuntimeError, ValueError):  # (sliding-window and linear-attention layers keep no positions to
                pass  # cut: the cache stays padded; a call given it is refused, as under SP any cached call is)
        return keep_logits(trim_output(output, extra, padded_length), kept)


class _GatherSequence:
    """Forward hook of the stage's last block: the whole sequence again, for replicated code."""

    def __init__(self, tp_group: Group) -> None:
        self.tp_group = tp_group

    def __call__(self, module: nn.Module, args: tuple, output):
        if isinstance(output, tuple):
            return (self._gather(output[0]), *output[1:])
        return self._gather(output)

    def _gather(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_from_sequence(hidden, self.tp_group, partial_grad=False)  # [b, s/tp, h] -> [b, s, h]


def _matching(model: nn.Module, patterns: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    regexes = [compile_pattern(p) for p in patterns]
    return [(n, m) for n, m in model.named_modules() if n and any(r.match(n) for r in regexes)]


def apply_regions(
    model: nn.Module,
    rule_set: RuleSet,
    parallel: ParallelState,
    *,
    sequence_parallel: bool = False,
    chunks: tuple[range, ...] = (),
) -> RNGStreams:
    """Install the sequence-parallel region (when asked) and the random streams; returns the streams.

    ``chunks``: the block indices of each model chunk this pipeline rank runs (interleaved schedule); each
    chunk's blocks are a region of their own, since what crosses between chunks is the whole sequence."""
    streams = tp_streams(parallel)
    if parallel.tp_size == 1:
        return streams
    say = (lambda line: print(line, flush=True)) if parallel.rank == 0 else (lambda line: None)
    keep_streams_under_checkpointing(model, streams, say)  # HF's checkpointing, however the user turns it on
    blocks = local_blocks(model, rule_set)
    attach_whole_outputs(model, parallel.tp_group, sequence_parallel)  # (before the padding's trim: whole values)
    if sequence_parallel:
        if not blocks:
            raise UnsupportedModelError(
                f"sequence parallelism: the {rule_set.name} rules name no list of transformer blocks; "
                "turn megatron_lm_sequence_parallelism off for this model"
            )
        pad = _PadSequence(model, parallel.tp_size)
        model.register_forward_pre_hook(pad.before, with_kwargs=True)
        model.register_forward_hook(pad.after, with_kwargs=True, always_call=True)
        runs = [blocks[sum(map(len, chunks[:c])) :][: len(chunk)] for c, chunk in enumerate(chunks)] or [blocks]
        for run in runs:  # blocks in index order, chunk after chunk
            run[0].register_forward_pre_hook(_SplitSequence(parallel.tp_group), with_kwargs=True)
            run[-1].register_forward_hook(_GatherSequence(parallel.tp_group))
        for block in blocks:
            for param in block.parameters():
                info = param_info(param)
                if not is_tensor_parallel(param) and not info.tp_shared:
                    set_param_info(param, sequence_parallel=True)
            ForkAround(streams, TP_STREAM).register(block)  # every activation in a block is split
        return streams
    for _, module in _matching(model, rule_set.split_random):
        ForkAround(streams, TP_STREAM).register(module)
    split_names = [n for n, _ in _matching(model, rule_set.split_random)]
    for name, module in _matching(model, rule_set.residual_dropouts):
        if any(name.startswith(s + ".") for s in split_names):
            ForkAround(streams, DEFAULT_STREAM).register(module)  # replicated input inside a TP-forked module
    return streams
