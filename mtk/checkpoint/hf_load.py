"""Build a tensor-parallel model from a local HF directory without materializing the full model.

The model skeleton is created with parameters on the meta device (buffers such as rotary
frequencies stay real), converted by the rules, and then each parameter is filled with exactly
this rank's slice, read with positioned reads (:mod:`mtk.checkpoint.safetensors_slices`) so that
only those bytes leave the disk and nothing else is ever resident.
Weights load only from safetensors: a directory with only pickled ``.bin`` weights is refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from accelerate import init_empty_weights
from torch import nn
from transformers import PretrainedConfig
from transformers.utils import GENERATION_CONFIG_NAME

from mtk import jsonio
from mtk.checkpoint.hf_conversion import converted_tensors
from mtk.checkpoint.safetensors_slices import open_safetensors
from mtk.convert import parallelize
from mtk.errors import CheckpointError
from mtk.models import (
    ModelSpecError,
    auto_class_for,
    check_weights,
    generation_config_of,
    resolve_config,
    whole_parameters,
)
from mtk.parallel.expert_parallel import own_expert_rows, spread_experts
from mtk.parallel.gather import full_shape_and_spec
from mtk.parallel.grads import sum_grad_over_tp
from mtk.parallel.parameters import copy_param_info, param_info
from mtk.parallel.sharding import take_shard
from mtk.parallel.state import ParallelState

__all__ = ["CheckpointError", "empty_model", "load_pretrained_tp", "load_slices", "safetensors_index"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def safetensors_index(directory: str | Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file holding it (single file or sharded with an index)."""
    directory = Path(directory)
    if (directory / INDEX_FILE).is_file():
        try:
            weight_map = jsonio.read(directory / INDEX_FILE)["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{directory / INDEX_FILE} is not a valid safetensors index ({err})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{directory / INDEX_FILE} is not a valid safetensors index (weight_map)")
        outside = sorted({f for f in weight_map.values() if Path(f).name != f or f in (".", "..")})
        if outside:  # HF writes shard names beside the index; a path elsewhere would be read from outside the model
            raise CheckpointError(
                f"{directory / INDEX_FILE} maps tensors to {outside[0]!r}, which is not a file beside it; "
                "a model directory holds its own shards"
            )
        index = {name: directory / file for name, file in weight_map.items()}
        for path in set(index.values()):
            if not path.is_file():
                raise CheckpointError(f"{path} is listed in {INDEX_FILE} but does not exist")
        return index
    if (directory / SINGLE_FILE).is_file():
        with open_safetensors(directory / SINGLE_FILE) as handle:
            return {name: directory / SINGLE_FILE for name in handle.keys()}
    check_weights(directory)  # only pickles: one line saying so
    raise CheckpointError(f"{directory} has no {SINGLE_FILE} or {INDEX_FILE}")


def _checkpoint_key(name: str, index: dict[str, Path], prefix: str, tied_to: str | None = None) -> str:
    """The checkpoint's name for parameter ``name`` (a base model saved without its task head's prefix;
    a pipeline's last-stage copy of a tied embedding stored under the embedding's name)."""
    candidates = [name]
    if prefix and name.startswith(prefix + "."):
        candidates.append(name[len(prefix) + 1 :])
    elif prefix:
        candidates.append(f"{prefix}.{name}")
    for key in candidates:
        if key in index:
            return key
    if tied_to is not None:
        return _checkpoint_key(tied_to, index, prefix)
    raise CheckpointError(f"the checkpoint has no tensor for parameter {name!r} (looked for {candidates})")


def _checkpoint_key_or_none(name: str, index: dict[str, Path], prefix: str) -> str | None:
    try:
        return _checkpoint_key(name, index, prefix)
    except CheckpointError:
        return None


def empty_model(
    directory: str | Path,
    *,
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = None,
    config: PretrainedConfig | None = None,
) -> nn.Module:
    """The HF model saved in ``directory`` as ``from_pretrained`` builds it (its config, generation config, tied
    weights), but with every parameter on the meta device and nothing read: convert it
    (:func:`mtk.convert.parallelize`), then :func:`load_slices` reads this rank's slices into it.

    ``dtype``: the parameters' (default: the config's); ``config``: the directory's, already read and edited (as
    ``from_pretrained`` applies keyword arguments that name config attributes)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelSpecError(f"model directory {directory} does not exist")
    config = config or resolve_config(str(directory))
    options = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    with init_empty_weights(include_buffers=False), whole_parameters():  # (ZeRO-3's zero.Init partitioned it)
        model = auto_class_for(config).from_config(config, dtype=dtype or getattr(config, "dtype", None), **options)
    model.tie_weights()  # init_empty_weights re-creates each registered parameter, which unties shared ones
    if model.can_generate() and (directory / GENERATION_CONFIG_NAME).is_file():
        model.generation_config = generation_config_of(directory)
    return model


def load_slices(model: nn.Module, directory: str | Path, parallel: ParallelState) -> None:
    """Fill ``model`` (built by :func:`empty_model`, converted for ``parallel``: its parameters still on the meta
    device) with this rank's slice of each tensor in ``directory``'s safetensors, in the parameter's dtype; in
    evaluation mode, as HF's ``from_pretrained`` returns a model."""
    index = safetensors_index(directory)
    _check_layer_count(index, model, directory)
    unused = set(_fill_from_checkpoint(model, index, parallel))
    if parallel.pp_size > 1:  # a stage reads its own layers: unused is what no stage read
        stages: list[Any] = [None] * parallel.pp_size
        dist.all_gather_object(stages, unused, group=parallel.pp_group)
        unused = set.intersection(*stages)
    if unused and parallel.rank == 0:  # as from_pretrained's load report, in one line: a tensor the config builds
        # no module for (a Qwen3 checkpoint's q_norm under a config without it) would otherwise be dropped unseen
        names = sorted(unused)
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        print(f"mtk: {directory}: {len(names)} tensor(s) no parameter of the model uses, not loaded: {shown}",
              flush=True)  # fmt: skip
    if parallel.ep_size > 1:  # each rank read its own experts of its TP slice
        spread_experts(model, parallel.ep_group, parallel.pp_group, read_local=True)
    model.eval()


def _rows_of(read: Callable[[tuple[slice, ...]], torch.Tensor], rows: tuple[int, int]) -> Callable:
    """``read`` of the tensor's rows ``[start, stop)`` alone: an index into those rows, shifted into the whole."""

    def read_rows(index: tuple[slice, ...]) -> torch.Tensor:
        first = index[0]
        start = rows[0] + (first.start or 0)
        stop = rows[0] + (first.stop if first.stop is not None else rows[1] - rows[0])
        return read((slice(start, stop), *index[1:]))

    return read_rows


_LAYER = re.compile(r"(?:^|\.)(?:layers|h|layer|blocks)\.(\d+)\.")


def _check_layer_count(index: dict[str, Path], model: nn.Module, directory: str | Path) -> None:
    """Weights for more decoder layers than the config builds are one line: the extra layers would be dropped
    without a word (HF only logs them as unexpected keys), and the run would train a shallower model than the
    directory's. Only the model's own layer stack counts (its parameters' ``<prefix>.layers.<i>.`` prefix; another
    stack, a vision tower's, is not compared), and multi-token-prediction layers a config declares are allowed."""
    config = cast(Any, model).config
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int):
        return
    layers += getattr(config, "num_nextn_predict_layers", 0) or 0
    prefixes = {name[: m.start(1)] for name, _ in model.named_parameters() if (m := _LAYER.search(name))}
    found = [int(m.group(1)) for name in index if (m := _LAYER.search(name)) and name[: m.start(1)] in prefixes]
    if found and max(found) >= layers:
        raise CheckpointError(
            f"{directory} holds weights for {max(found) + 1} layers but its config builds {layers} "
            "(num_hidden_layers): config and weights disagree"
        )


def load_pretrained_tp(
    directory: str | Path,
    parallel: ParallelState,
    *,
    dtype: torch.dtype | None = None,
    logits: str = "auto",
    pad_vocab_to_multiple_of: int = 1,
    pipeline_layers: tuple[int, ...] = (),
    sequence_parallel: bool = False,
    virtual_stages: int = 1,
    loss_chunk_tokens: int | None = None,
) -> nn.Module:
    """A tensor-parallel HF model whose every parameter holds only this rank's slice of the checkpoint.

    With ``parallel.pp_size > 1`` the model is also cut to this rank's pipeline stage (``pipeline_layers``
    per stage, else :mod:`mtk.pipeline.balance`'s default; ``virtual_stages`` chunks per rank for the
    interleaved schedule) before anything is read, so a rank reads only its own stage's layers (wrap it in
    :class:`~mtk.pipeline.engine.PipelineModel` to run it, or let ``mtk.Accelerator.prepare`` do that).
    """
    model = empty_model(directory, dtype=dtype)
    parallelize(
        model,
        parallel,
        logits=logits,
        pad_vocab_to_multiple_of=pad_vocab_to_multiple_of,
        pipeline_layers=pipeline_layers,
        virtual_stages=virtual_stages,
        sequence_parallel=sequence_parallel,
        loss_chunk_tokens=loss_chunk_tokens,
    )
    load_slices(model, directory, parallel)
    return model


def _fill_from_checkpoint(model: nn.Module, index: dict[str, Path], parallel: ParallelState) -> list[str]:
    """Read this rank's slice of every parameter (with EP, of its own experts only); returns the checkpoint's
    tensors it did not use."""
    device, tp_group = parallel.device, parallel.tp_group
    prefix = getattr(model, "base_model_prefix", "")
    owners: dict[int, list[tuple[nn.Module, str]]] = {}  # tied parameters have several owners
    for module in model.modules():
        for attr, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, attr))
    with ExitStack() as stack:
        handles = {path: stack.enter_context(open_safetensors(path)) for path in sorted(set(index.values()))}
        # tensors transformers assembles while loading (MoE experts stored per expert): read from their sources
        lookup = (type(model).__name__, cast(Any, model).config.model_type)
        converted = converted_tensors(lookup, list(index), lambda key: handles[index[key]].get_slice(key))
        read: set[str] = set()  # the checkpoint keys the model's parameters come from
        for name, param in list(model.named_parameters()):  # one name per tied group
            source = converted.get(name) or converted.get(name.partition(".")[2] if prefix else "")
            if isinstance(source, str):  # renamed only: read it under its checkpoint name
                key, tensor_slice = source, handles[index[source]].get_slice(source)
            elif source is not None:
                key, tensor_slice = name, source
                read.update(source.sources)
            else:
                key = _checkpoint_key(name, index, prefix, param_info(param).tied_to)
                tensor_slice = handles[index[key]].get_slice(key)
            full_shape, spec = full_shape_and_spec(model, name)
            if tuple(tensor_slice.get_shape()) != tuple(full_shape):
                raise CheckpointError(
                    f"{key} in the checkpoint has shape {tuple(tensor_slice.get_shape())}, the model expects "
                    f"{tuple(full_shape)} (config and weights disagree)"
                )
            read.add(key)
            module_name, _, attr = name.rpartition(".")
            rows = own_expert_rows(model.get_submodule(module_name), attr, parallel.ep_group)
            reader = tensor_slice.__getitem__ if rows is None else _rows_of(tensor_slice.__getitem__, rows)
            if rows is not None:  # [E, ...] -> [E/ep, ...]: this rank's experts, then its TP slice of them
                full_shape = (rows[1] - rows[0], *full_shape[1:])
            local = take_shard(spec, full_shape, reader)  # owned, contiguous: this rank's bytes
            real = nn.Parameter(local.to(device=device, dtype=param.dtype), requires_grad=param.requires_grad)
            copy_param_info(param, real)
            if param_info(real).tp_shared:  # the gradient hook belongs to the tensor: give the new one its own
                sum_grad_over_tp(real, tp_group)
            for module, attr in owners[id(param)]:
                setattr(module, attr, real)
        _fill_buffers(model, index, handles, converted, read, device)
    # every name of a tied group was read (a checkpoint may hold the head under its own name too)
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    for names in aliases.values():
        if any(_checkpoint_key_or_none(n, index, prefix) in read for n in names):
            read.update(k for n in names if (k := _checkpoint_key_or_none(n, index, prefix)) is not None)
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if still_meta:
        raise CheckpointError(f"tensors not filled from the checkpoint: {still_meta[:5]}")
    return unused_tensors(model, index, read)


def _fill_buffers(
    model: nn.Module, index: dict[str, Path], handles: dict, converted: dict[str, Any], read: set[str], device
) -> None:
    """The persistent buffers the checkpoint holds, as ``from_pretrained`` loads them: a trained router's
    ``e_score_correction_bias`` (GLM-4-MoE, DeepSeek-V3) is a buffer, and its initial zeros would route differently
    from the checkpoint without a word. A buffer the checkpoint lacks keeps the model's own value, as in HF."""
    prefix = getattr(model, "base_model_prefix", "")
    for module_name, module in model.named_modules():
        for attr, buffer in module.named_buffers(recurse=False):
            if buffer is None or attr in module._non_persistent_buffers_set:
                continue
            name = f"{module_name}.{attr}" if module_name else attr
            source = converted.get(name) or converted.get(name.partition(".")[2] if prefix else "")
            key = source if isinstance(source, str) else _checkpoint_key_or_none(name, index, prefix)
            if key is None:
                continue
            slicer = handles[index[key]].get_slice(key)
            if tuple(slicer.get_shape()) != tuple(buffer.shape):
                raise CheckpointError(
                    f"{key} in the checkpoint has shape {tuple(slicer.get_shape())}, the model's buffer {name} "
                    f"{tuple(buffer.shape)} (config and weights disagree)"
                )
            value = slicer[tuple(slice(None) for _ in buffer.shape)]
            with torch.no_grad():
                buffer.copy_(value.to(device=buffer.device, dtype=buffer.dtype))
            read.add(key)


def unused_tensors(model: nn.Module, index: dict[str, Path], read: set[str]) -> list[str]:
    """The checkpoint's tensors no parameter came from, but for those ``from_pretrained`` drops by design: the
    model's buffers (rotary frequencies and position ids some versions saved), the keys its class lists in
    ``_keys_to_ignore_on_load_unexpected``, and multi-token-prediction layers its config declares (beyond
    ``num_hidden_layers``, which :func:`_check_layer_count` allowed)."""
    prefix = getattr(model, "base_model_prefix", "")
    buffers = {name for name, _ in model.named_buffers()}
    buffers |= {f"{prefix}.{name}" for name in buffers} | {name.partition(".")[2] for name in buffers}
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    config = cast(Any, model).config
    layers = getattr(config, "num_hidden_layers", None)
    unused = []
    for key in index:
        if key in read or key in buffers or any(p.search(key) for p in ignored):
            continue
        layer = _LAYER.search(key)
        if layer and isinstance(layers, int) and int(layer.group(1)) >= layers:
            continue  # a declared MTP layer (more than declared: refused before)
        unused.append(key)
    return unused
