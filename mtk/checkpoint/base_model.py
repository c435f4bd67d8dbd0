"""What an adapter-only checkpoint was trained on: the frozen base model's name and a fingerprint of its weights.

A LoRA checkpoint (``step_N`` of a ``PeftModel``) stores only the trainable parameters; resuming it against
another base would silently train a different model. The fingerprint is a function of the base's full weights
only, not of the layout that computes it: the frozen parameters' count, full element count, and the fp64 sums of
their elements, magnitudes and squares, each rank adding its shard (vocabulary padding adds zeros; a copy held by
several TP ranks adds ``1 / copies`` each; FSDP2's and ZeRO-3's pieces of a shard add once each; another stage's
copy of a tied embedding adds nothing; experts spread over EP are added by the first of the ranks holding each:
every expert once). Two bases agree
when the counts are equal and the sums agree to 1e-9 of their scale (the order of additions differs by layout).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from mtk.errors import CheckpointError
from mtk.parallel.fsdp import counted_here, local
from mtk.parallel.gather import full_shape_and_spec
from mtk.parallel.parameters import param_info
from mtk.parallel.pieces import Piece, flat_piece
from mtk.parallel.record import adapter_configs, is_peft_model
from mtk.parallel.state import ParallelState

__all__ = [
    "base_record",
    "check_adapter_settings",
    "check_base",
    "checkpointed_buffers",
    "checkpointed_parameters",
    "differs",
    "fingerprint",
]

TOLERANCE = 1e-9

# The settings of a PEFT LoRA config that decide what the adapters compute or which weights train. A resume with
# another value trains another model from the resumed step on without a shape to disagree (lora_alpha 8 -> 32
# rescales every update): mtk's scripts guard their --lora_* flags, this guards any PEFT config (the Trainer's
# peft_config, a user's get_peft_model) against what the checkpoint records.
_ADAPTER_SETTINGS = (
    "r",
    "lora_alpha",
    "use_rslora",
    "lora_dropout",
    "target_modules",
    "target_parameters",
    "exclude_modules",
    "layers_to_transform",
    "layer_replication",
    "layers_pattern",
    "rank_pattern",
    "alpha_pattern",
    "bias",
    "lora_bias",
    "modules_to_save",
    "use_dora",
    "fan_in_fan_out",
)


def checkpointed_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The parameters a checkpoint stores: all of them, or a ``PeftModel``'s trainable ones (adapters and
    ``modules_to_save``), the frozen base being recorded by :func:`base_record` instead."""
    adapters_only = is_peft_model(model)
    for name, param in model.named_parameters():
        if param.requires_grad or not adapters_only:
            yield name, param


def checkpointed_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The persistent buffers a checkpoint stores beside the parameters: those ``from_pretrained`` reads from an HF
    directory and ``save_pretrained`` writes (a router's ``e_score_correction_bias``, Gemma 4's ``layer_scalar``).
    An export without them loads them as the class initialises them (zeros: other experts chosen) without a word.
    None for a ``PeftModel``: its frozen base holds them and is recorded by :func:`base_record`."""
    if is_peft_model(model):
        return
    for module_name, module in model.named_modules():
        for attr, buffer in module.named_buffers(recurse=False):
            if buffer is not None and attr not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{attr}" if module_name else attr), buffer


def fingerprint(model: nn.Module, parallel: ParallelState | None = None) -> dict[str, float]:
    """``{"parameters", "elements", "sum", "sum_abs", "sum_sq"}`` of the whole model's frozen weights (collective
    with ``parallel``); without ``parallel``, of every weight of a single-process model (the HF base that
    ``mtk export --merge`` reads)."""
    device = parallel.device if parallel else torch.device("cpu")
    totals = torch.zeros(5, dtype=torch.float64, device=device)
    replica_rank = parallel.replica_rank if parallel else 0  # DP x CP: the ranks with the same weights
    first = parallel is None or parallel.tp_rank == 0
    for name, param in model.named_parameters():
        info = param_info(param)
        if (param.requires_grad and parallel is not None) or info.pipeline_duplicate:
            continue
        zero3 = hasattr(param, "ds_tensor")  # partitioned over the replicas by DeepSpeed: each piece counts once
        if parallel is not None and info.expert_parallel:  # this EP rank's experts: their first holder counts them
            if parallel.expert_replica_ranks[0] != parallel.rank:
                continue
        elif not zero3 and not counted_here(param, replica_rank):  # one replica (FSDP2: each piece of the first)
            continue
        shape, spec = full_shape_and_spec(model, name)
        if spec.is_replicated and not first:
            continue
        held = _zero3_elements(param) if zero3 else local(param)
        values = held.detach().to(device, torch.float64)  # [shard, or this rank's piece of it]
        weight = 1.0 if spec.is_replicated else 1.0 / info.tp_replicas
        if replica_rank == 0:  # the parameter itself is counted once, whatever splits it
            totals[0] += float(first)
            totals[1] += float(torch.Size(shape).numel()) * first
        totals[2:] += torch.stack([values.sum(), values.abs().sum(), values.square().sum()]) * weight
    if parallel is not None and dist.is_initialized():
        dist.all_reduce(totals)
    count, elements, total, absolute, squares = totals.tolist()
    return {"parameters": int(count), "elements": int(elements), "sum": total, "sum_abs": absolute, "sum_sq": squares}


def _zero3_elements(param: nn.Parameter) -> torch.Tensor:
    """This rank's elements of a ZeRO-3 parameter: DeepSpeed's piece without its padding, which is allocated with
    ``torch.empty`` and never written for a frozen parameter (any bytes, NaN too, on the last rank's tail and on a
    rank whose piece starts past the end)."""
    group = cast(Any, param).ds_process_group
    found = flat_piece(param, Piece(dist.get_rank(group=group), dist.get_world_size(group=group)))
    return found[0] if found else cast(Any, param).ds_tensor[:0]  # [this rank's elements]


def base_record(model: nn.Module, parallel: ParallelState) -> dict[str, Any] | None:
    """The base of a ``PeftModel`` (``None`` for any other model): its name or directory and fingerprint.
    Collective: every rank calls it."""
    if not is_peft_model(model):
        return None
    config = getattr(model, "config", None)
    return {
        "name_or_path": getattr(config, "_name_or_path", "") or getattr(config, "model_type", ""),
        "peft_type": str(next(iter(cast(Any, model).peft_config.values())).peft_type.value),
        "fingerprint": fingerprint(model, parallel),
        "dtype": _frozen_dtypes(model),
    }


def _frozen_dtypes(model: nn.Module) -> str:
    """The dtypes the frozen base is held in (``--base_dtype``) over every rank: ``"torch.bfloat16"``, or several
    joined (a stage may keep a module in fp32). Collective where a process group exists."""
    held: set[str] = {str(p.dtype) for p in model.parameters() if not p.requires_grad}
    if dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(held))
        held = {dtype for part in gathered for dtype in part}
    return ",".join(sorted(held))


def differs(saved: dict[str, float], current: dict[str, float]) -> bool:
    if (saved["parameters"], saved["elements"]) != (current["parameters"], current["elements"]):
        return True
    scale = max(saved["sum_abs"], 1.0)  # a sum near zero is compared on the scale of its terms
    return any(abs(saved[key] - current[key]) > TOLERANCE * scale for key in ("sum", "sum_abs")) or abs(
        saved["sum_sq"] - current["sum_sq"]
    ) > TOLERANCE * max(saved["sum_sq"], 1.0)


def check_base(directory: str, saved: dict[str, Any] | None, model: nn.Module, parallel: ParallelState) -> None:
    """One clear line when an adapter checkpoint meets a model it does not belong to. Collective."""
    adapters = is_peft_model(model)
    if saved is None and adapters:
        raise CheckpointError(
            f"{directory} holds a full model, this run trains LoRA adapters; resume it without the --lora_* options"
        )
    if saved is None:
        return
    if not adapters:
        raise CheckpointError(
            f"{directory} holds only LoRA adapters (base {saved['name_or_path']}); resume it with the same --lora_* "
            "options, or `mtk export --merge` it for a full model"
        )
    current = fingerprint(model, parallel)
    dtype = _frozen_dtypes(model)
    if saved.get("dtype", dtype) != dtype:  # (checkpoints before the dtype was recorded: the sums say it)
        raise CheckpointError(
            f"{directory} holds adapters trained on the base {saved['name_or_path']!r} held in {saved['dtype']!r}; "
            f"this run holds it in {dtype!r} (--base_dtype): resume with the base in the dtype it was trained in"
        )
    if differs(saved["fingerprint"], current):
        raise CheckpointError(
            f"{directory} holds adapters trained on the base {saved['name_or_path']!r} "
            f"({saved['fingerprint']['elements']} weights, sum {saved['fingerprint']['sum']:.9g}); this run's base "
            f"has {current['elements']} weights, sum {current['sum']:.9g}: resume on the base it was trained on"
        )


def check_adapter_settings(directory: str, saved: dict[str, Any] | None, model: nn.Module) -> None:
    """One line when this run's adapters differ from the ones ``directory`` recorded (their names, or a setting of
    :data:`_ADAPTER_SETTINGS`); nothing when either side has none (:func:`check_base` says that)."""
    if not saved or not is_peft_model(model):
        return
    current = adapter_configs(model)
    if sorted(saved) != sorted(current):
        raise CheckpointError(
            f"{directory} holds the adapters {sorted(saved)}, this run has {sorted(current)}: resume with the same"
        )
    names = [name for name, _ in cast(Any, model).get_base_model().named_modules()]
    for name, record in current.items():
        for key in _ADAPTER_SETTINGS:
            before, now = saved[name].get(key), record.get(key)
            if key == "target_modules" and _selected(before, names) == _selected(now, names):
                continue  # the same modules named another way (a regular expression, a list)
            if before != now:
                raise CheckpointError(
                    f"this run changes {key} {before!r} -> {now!r} of the adapter {name!r} from the checkpoint it "
                    f"resumes ({directory}), which would train another model from there; resume with the "
                    "checkpoint's LoRA settings, or start a new run from its merged weights (mtk export --merge)"
                )


def _selected(targets: Any, names: list[str]) -> set[str] | None:
    """The module names ``target_modules`` selects, as PEFT matches them (a string: a regular expression of the
    whole name; a list: names or name suffixes); ``None`` for another kind of value."""
    if isinstance(targets, str):
        return {name for name in names if re.fullmatch(targets, name)}
    if isinstance(targets, list):
        return {name for name in names if name in targets or any(name.endswith(f".{t}") for t in targets)}
    return None
