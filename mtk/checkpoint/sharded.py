"""Training checkpoints: ``ckpts/step_N/`` with one shard per (tp, pp) rank, split by concern.

This module only orchestrates: which rank writes what, in which order. The parts live in their own
modules: file names (:mod:`~mtk.checkpoint.paths`), metadata (:mod:`~mtk.checkpoint.meta`), weights
(:mod:`~mtk.checkpoint.weights`), optimizer state (:mod:`~mtk.checkpoint.optimizer`), RNG
(:mod:`~mtk.checkpoint.rng`), and the all-or-nothing directory (:mod:`~mtk.checkpoint.atomic`).

Weights and optimizer state are keyed by HF parameter names and carry their shard specs, so a
checkpoint can be merged (export) or re-split at another layout. Files are read back only as
safetensors, JSON, or ``torch.load(weights_only=True)``. Several nodes must share the checkpoint
filesystem.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn

from mtk.checkpoint.atomic import atomic_dir, write_synced
from mtk.checkpoint.base_model import (
    base_record,
    check_adapter_settings,
    check_base,
    checkpointed_buffers,
    checkpointed_parameters,
)
from mtk.checkpoint.counts import (
    check_learning_rates,
    check_optimizer_steps,
    check_scheduler_positions,
    optimizer_steps,
    recorded_counts,
)
from mtk.checkpoint.integrity import Checksums, checksum_files, missing_files_are_one_line, read_verified
from mtk.checkpoint.labels import KEY, labelled, new_label
from mtk.checkpoint.meta import FORMAT, RUN_ID, CheckpointMeta, read_metadata
from mtk.checkpoint.optimizer import (
    check_settings_agree,
    load_optimizer,
    reshard_optimizer,
    save_optimizer,
    saved_optimizer_groups,
)
from mtk.checkpoint.optimizer_checks import check_scheduler_state
from mtk.checkpoint.paths import CheckpointPaths, reading
from mtk.checkpoint.reader import ShardedCheckpointReader
from mtk.checkpoint.rng import restore_rng, rng_state
from mtk.checkpoint.weights import load_weights, reshard_weights, save_weights
from mtk.errors import CheckpointError
from mtk.parallel.distributed_optimizer import full_optimizer_state
from mtk.parallel.expert_parallel import is_expert_parallel
from mtk.parallel.fsdp import local, module_class, piece_of
from mtk.parallel.gather import full_shape_and_spec
from mtk.parallel.layout import Layout
from mtk.parallel.pieces import Piece
from mtk.parallel.record import adapter_configs, hf_model, is_peft_model, parallelized
from mtk.parallel.state import ParallelState

T = TypeVar("T")

__all__ = [
    "FORMAT",
    "load_checkpoint",
    "read_metadata",
    "restore_rng",
    "restore_streams",
    "save_checkpoint",
    "topology_of",
]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _versions() -> dict[str, str]:
    return {name: version(name) for name in ("mtk", "torch", "transformers", "accelerate")}


def _check_finite_weights(model: nn.Module, parallel: ParallelState, step: int) -> None:
    """Refuse (every rank, one line) to save weights holding NaN or infinity: such a checkpoint is whole and
    verifies, yet nothing can train from it. The runs' checks stop at a non-finite loss or gradient norm; weights
    turn non-finite without either where an update's own numbers are (a weight decay of ``1e400``, a resumed
    optimizer state that was damaged). Collective: every rank learns whether any rank holds one."""
    held = [(name, local(param.detach())) for name, param in checkpointed_parameters(model)]
    finite = torch.stack([torch.isfinite(t).all() for _, t in held]).all() if held else torch.tensor(True)
    flag = (~finite).to(parallel.device, torch.float32).reshape(1)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0:
        return
    bad = next((name for name, tensor in held if not bool(torch.isfinite(tensor).all())), None)
    where = f"{bad} holds NaN or infinity" if bad is not None else "another rank's weights hold NaN or infinity"
    raise CheckpointError(
        f"step {step}: {where}, so it is not saved (the last saved step is left as it is): the update made the "
        "weights non-finite; check the optimizer settings (learning rate, weight decay) or resume from an earlier step"
    )


def topology_of(parallel: ParallelState) -> Layout:
    return parallel.layout


def _model_record(model: nn.Module) -> dict[str, Any]:
    record = parallelized(model)
    return {
        "class": module_class(hf_model(model)).__name__,
        "rules": record.rule_set.name if record else None,
        "config": cast(Any, model).config.to_dict() if hasattr(model, "config") else None,
        **({"adapters": adapter_configs(model)} if is_peft_model(model) else {}),
    }


def save_checkpoint(
    directory: str | Path,
    parallel: ParallelState,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    schedulers: list,
    *,
    step: int,
    extra_rng: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    writers: Sequence[Callable[[Path], None]] = (),
    collective_writers: Sequence[Callable[[Path, str], None]] = (),
    piece: Piece | None = None,
    engine_state: list[list[float]] | None = None,
    engine_optimizers: list[Any] | None = None,
) -> Path:
    """Write a checkpoint at ``directory`` atomically. Collective: every rank calls it.

    ``data`` is the data position; ``engine`` names the engine that owns extra state (DeepSpeed).
    ``writers`` run on rank 0 with the (still incomplete) directory, e.g. to save a tokenizer;
    ``collective_writers`` run on every rank with the directory and the save's label (e.g. DeepSpeed's own,
    collective, save_checkpoint, and mtk's ZeRO-3 pieces, which carry the label: :mod:`~mtk.checkpoint.labels`).
    ``piece``: where this rank's pieces sit when the model's parameters are split over DP by an engine (ZeRO-3);
    FSDP2's are found from the parameters themselves. ``engine_state``: every rank's sums of the engine's optimizer
    state (:func:`~mtk.checkpoint.counts.engine_state_sums`), recorded in ``counts`` to check its own files by;
    ``engine_optimizers``: the engine's own optimizers (DeepSpeed's inner one), whose steps and learning rates the
    counts record as they do ``optimizers``'.
    """
    _check_finite_weights(model, parallel, step)
    counted = optimizers if engine is None else engine_optimizers
    counts = recorded_counts(counted, schedulers, parallel.device)  # collective
    if engine_state is not None:
        counts["engine_state"] = engine_state
    piece = _with_experts(piece or piece_of(model), model, parallel)
    label = new_label(step)  # collective: every file this save writes carries it
    if piece is not None and len(optimizers) > 1:  # a checkpoint in pieces is read back through the resharding
        raise CheckpointError(  # reader, which restores one optimizer
            f"saving {len(optimizers)} optimizers with parameters split over data parallelism (FSDP2) or experts "
            "spread over expert parallelism is not supported; use one optimizer (parameter groups for different "
            "settings)"
        )
    with atomic_dir(directory, owner=parallel.rank == 0, barrier=_barrier) as tmp:
        paths = CheckpointPaths(tmp)
        if parallel.rank == 0:
            paths.make_dirs()
        _barrier()
        checksums = Checksums(tmp)  # hashes each big file in the background while the next is written
        # weights and optimizer are replicated over DP x CP: one copy per (tp, pp), written by replica rank 0 (a
        # distributed optimizer first gathers its state there: collective, every replica takes part). FSDP2 splits
        # them over DP (ZeRO-3 too): each rank writes its own flat piece of its TP shard (HSDP: the first replica).
        # Under EP each rank of the first EP group writes its experts as its piece (piece 0 the dense tensors too;
        # a LoRA factor whose experts are no run, lora_B, gathered and written whole by EP rank 0)
        index = piece.index if piece is not None else None
        tp, pp = parallel.tp_rank, parallel.pp_rank
        with full_optimizer_state(optimizers, gather=True):
            if piece.writes if piece is not None else parallel.replica_rank == 0:
                # the biggest files first (Adam's are twice the weights): only the last one's hash is not hidden
                for i, optimizer in enumerate(optimizers):
                    stem, groups = paths.optimizer(tp, pp, i, piece=index), paths.optimizer(tp, pp, i)
                    save_optimizer(model, optimizer, stem, piece, groups=groups.with_suffix(".json"), label=label)
                    checksums.add(stem.with_suffix(".safetensors"))
                weights = paths.weights(tp, pp, index)
                save_weights(model, weights, piece, label=label)
                checksums.add(weights)
        for write_labelled in collective_writers:
            write_labelled(tmp, label)
        rng = rng_state({**(extra_rng or {}), **_streams_state(model)})
        torch.save(labelled(rng, label), paths.rng(parallel.rank))
        if parallel.rank == 0:
            for write in writers:
                write(tmp)
            for i, scheduler in enumerate(schedulers):
                torch.save(labelled(scheduler.state_dict(), label), paths.scheduler(i))
        base = base_record(model, parallel)  # collective; adapter-only checkpoints name their frozen base
        _barrier()  # every rank's files are in place before they are hashed and the metadata says "complete"
        files = checksum_files(tmp, checksums)  # collective: each rank hashes and fsyncs its share
        if parallel.rank == 0:
            meta = CheckpointMeta(
                step=step,
                topology=topology_of(parallel),
                versions=_versions(),
                model=_model_record(model),
                data={"micro_batches": 0, **(data or {})},  # a position always: its absence is a removed record
                run_id=RUN_ID,
                files=files,
                base_model=base,
                counts=counts,
                save=label,
                pieces=piece.count if piece is not None else None,
                **(engine or {}),
            )
            write_synced(paths.metadata, meta.to_json())
    return Path(directory)


@missing_files_are_one_line
def load_checkpoint(
    directory: str | Path,
    parallel: ParallelState,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    schedulers: list,
) -> CheckpointMeta:
    """Restore weights, optimizer, scheduler and RNG from ``directory``; returns its metadata.

    Every file is checked against the checksums in the metadata first (collective). A checkpoint
    written at another TP/PP layout is resharded: each tensor (and optimizer moment) is
    merged from the old shards and this rank's new shard cut from it. A changed DP size needs no
    resharding (weights are replicated over DP). At another rank grid every rank takes rank 0's RNG states
    (:func:`~mtk.checkpoint.rng.restore_rng`).
    """
    meta = read_verified(directory)  # collective: every file matches its checksum, or every rank refuses
    if meta.engine is not None:  # its optimizer state is the engine's own, which this loader does not read
        raise CheckpointError(
            f"{directory} was written by the {meta.engine} engine (its optimizer state is in {meta.engine}/); resume "
            f"it under {meta.engine} (a Trainer or TRL script: --deepspeed with its JSON; run.py; or an accelerate "
            "config with distributed_type: DEEPSPEED), or take its weights with `mtk export`"
        )
    paths = CheckpointPaths(directory)
    saved = meta.topology
    check_base(str(directory), meta.base_model, model, parallel)  # collective
    check_adapter_settings(str(directory), meta.model.get("adapters"), model)
    # every rank loads all of the distributed optimizer's state, then keeps its own share; a rank holding experts
    # spread over EP reads its own experts (one tensor at a time, through the resharding reader)
    spread = _saves_spread_experts(model, parallel)
    if optimizers:  # read once, by rank 0: each TP rank's file of a stage holds the same settings
        _on_every_rank(parallel, lambda: _on_rank_zero(parallel, lambda: _check_settings(paths, saved, optimizers)))
    with full_optimizer_state(optimizers, gather=False):
        layout = (saved.tp_size, saved.etp_size, saved.pp_size, meta.pieces, spread)
        same_layout = layout == (parallel.tp_size, parallel.etp_size, parallel.pp_size, None, False)
        if same_layout and parallel.pp_size > 1:  # the same pp, but the layers may have been split otherwise
            same_layout = _every_rank(parallel, _holds_this_stage(paths, model, parallel))
        _on_every_rank(parallel, lambda: _load_state(directory, meta, model, optimizers, parallel, same_layout))
        if same_layout:
            _check_replicas_agree(model, optimizers, parallel, directory)  # each TP rank read its own file
    check_optimizer_steps(optimizer_steps(optimizers, parallel.device), meta.counts, str(directory))  # collective
    check_learning_rates(optimizers, meta.counts, str(directory))
    _on_every_rank(parallel, lambda: load_schedulers(paths, schedulers, meta.counts))
    meta.rng = _on_every_rank(parallel, lambda: restore_rng(paths, meta, parallel))
    restore_streams(model, meta, parallel)
    return meta


def _load_state(
    directory: str | Path,
    meta: CheckpointMeta,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    parallel: ParallelState,
    same_layout: bool,
) -> None:
    """This rank's weights and optimizer states: its own files at the same layout, else resharded from all."""
    paths, saved = CheckpointPaths(directory), meta.topology
    if same_layout:
        load_weights(model, paths.weights(parallel.tp_rank, parallel.pp_rank))
        for i, optimizer in enumerate(optimizers):
            load_optimizer(model, optimizer, paths.optimizer(parallel.tp_rank, parallel.pp_rank, i))
        return
    if len(optimizers) > 1:
        raise CheckpointError(
            "resharding a checkpoint (or reading one saved in FSDP2's pieces) supports one optimizer"
        )
    with ShardedCheckpointReader(directory, meta) as reader:
        if parallel.rank == 0:  # what each TP rank's file holds whole is one tensor (at the same layout: collective)
            reader.check_replicas_agree(optimizer=bool(optimizers))
        reshard_weights(model, reader)
        for optimizer in optimizers:
            reshard_optimizer(model, optimizer, reader, saved_optimizer_groups(paths, saved.pp_size))


def _holds_this_stage(paths: CheckpointPaths, model: nn.Module, parallel: ParallelState) -> bool:
    """Whether this rank's own weights file holds exactly the parameters of its stage: a checkpoint of another
    split of the layers over the same pp (``--pipeline_layers 4,1`` resumed at ``2,3`` or at the default split)
    has the same file names but other layers in them, and is resharded like any other layout."""
    path = paths.weights(parallel.tp_rank, parallel.pp_rank)
    if not path.is_file():
        return False
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        held = set(handle.keys()) - {name for name, _ in checkpointed_buffers(model)}
    return held == {name for name, _ in checkpointed_parameters(model)}


def _every_rank(parallel: ParallelState, holds: bool) -> bool:
    """Whether ``holds`` is true on every rank (collective)."""
    flag = torch.tensor([1.0 if holds else 0.0], device=parallel.device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _check_settings(paths: CheckpointPaths, saved: Layout, optimizers: list[torch.optim.Optimizer]) -> None:
    check_settings_agree(paths, saved.tp_size, saved.pp_size, len(optimizers))


def _on_rank_zero(parallel: ParallelState, check: Callable[[], None]) -> None:
    if parallel.rank == 0:
        check()


def _on_every_rank(parallel: ParallelState, load: Callable[[], T]) -> T:
    """``load()`` on every rank, refused on every rank when any rank refuses what it read (a file only it reads:
    its RNG state, its TP shard): that rank gives its line, the others name it, and none goes on alone into a
    collective the refusing rank never joins. Collective."""
    refusal: CheckpointError | None = None
    result = None
    try:
        result = load()
    except CheckpointError as err:
        refusal = err
    flag = torch.tensor([0.0 if refusal is None else float(parallel.rank + 1)], device=parallel.device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if refusal is not None:
        raise refusal
    if flag.item():
        raise CheckpointError(f"rank {int(flag.item()) - 1} refused the checkpoint (its line says why)")
    return cast(T, result)


def _check_replicas_agree(
    model: nn.Module, optimizers: list[torch.optim.Optimizer], parallel: ParallelState, directory: str | Path
) -> None:
    """The tensors every TP rank holds whole (norms, biases, replicated adapters) and their optimizer states, as each
    TP rank read them from its own file, are the same on every TP rank: files that disagree (crafted, or from two
    runs) would train TP ranks whose replicas differ, without a word. One sum and one sum of squares per tensor
    (fp64), gathered over TP. Collective over the TP group."""
    if parallel.tp_size == 1:
        return
    named = []
    for name, param in checkpointed_parameters(model):
        if full_shape_and_spec(model, name)[1].dim is not None:
            continue
        named.append((name, local(param.detach())))
        for optimizer in optimizers:
            state = optimizer.state.get(param, {}) if isinstance(optimizer.state, Mapping) else {}
            named += [
                (f"{name}::{k}", local(v)) for k, v in sorted(state.items()) if torch.is_tensor(v)
            ]  # (steps too)
    named += [(name, buffer) for name, buffer in checkpointed_buffers(model)]
    if not named:
        return
    mine = torch.stack([torch.stack([t.double().sum(), t.double().square().sum()]) for _, t in named])  # [N, 2]
    mine = mine.to(parallel.device)
    everyone = [torch.empty_like(mine) for _ in range(parallel.tp_size)]
    dist.all_gather(everyone, mine, group=parallel.tp_group)
    differs = torch.stack([(other != mine).any(dim=1) for other in everyone]).any(dim=0)  # [N]
    if bool(differs.any()):
        name = named[int(differs.nonzero()[0])][0]
        raise CheckpointError(
            f"{directory}: {name} differs between the TP ranks' files, though every TP rank holds it whole; "
            "the files are not from one save (crafted, or mixed from two runs): use another checkpoint"
        )


def _saves_spread_experts(model: nn.Module, parallel: ParallelState) -> bool:
    """Whether a checkpoint of ``model`` holds tensors spread over EP: experts, or the LoRA factors of expert tensors
    spread with them (not a LoRA run's frozen experts, which it does not hold). Decided for
    the whole model (collective): a pipeline stage of dense layers only writes pieces as the others do."""
    if parallel.ep_size == 1:
        return False
    here = any(is_expert_parallel(p) for _, p in checkpointed_parameters(model))
    anywhere = torch.tensor([int(here)], device=parallel.device)
    if dist.is_initialized():
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
    return bool(anywhere.item())


def _with_experts(piece: Piece | None, model: nn.Module, parallel: ParallelState) -> Piece | None:
    """Where this rank's experts spread over EP go: each is saved once, by the first of the ranks holding it. With
    nothing else split, EP rank ``r`` writes piece ``r`` of ``ep_size`` (piece 0 with the dense tensors); under
    FSDP2 its experts go into its FSDP2 piece (the first holders all lie in HSDP's first replica:
    :func:`~mtk.integrations.accelerate.init.check_expert_parallel`)."""
    if not _saves_spread_experts(model, parallel):
        return piece
    first_holder = parallel.expert_replica_ranks[0] == parallel.rank
    if piece is None:
        return Piece(parallel.ep_rank, parallel.ep_size, writes=first_holder)
    return replace(piece, experts=first_holder)


def _streams_state(model: nn.Module) -> dict[str, Any]:
    """The model's parked random streams (the per-TP-rank dropout stream), saved with this rank's RNG."""
    record = parallelized(model)
    return {"streams": record.rng.state_dict()} if record is not None and record.rng is not None else {}


def restore_streams(model: nn.Module, meta: CheckpointMeta, parallel: ParallelState) -> None:
    """Continue the TP stream where it stopped. At another layout the streams keep their fresh seeding:
    another rank's TP stream would give two ranks of one TP group the same masks."""
    record = parallelized(model)
    if record is None or record.rng is None or "streams" not in meta.rng:
        return
    mine = replace(topology_of(parallel), ep_size=1, etp_size=None)
    if replace(meta.topology, ep_size=1, etp_size=None) == mine:  # the experts' layout moves no TP rank
        record.rng.load_state_dict(meta.rng["streams"])


def load_schedulers(paths: CheckpointPaths, schedulers: list, counts: Mapping[str, Any]) -> None:
    """Each scheduler's state, checked (:func:`~mtk.checkpoint.optimizer_checks.check_scheduler_state`) and then
    at the position the metadata's ``counts`` recorded."""
    for i, scheduler in enumerate(schedulers):
        with reading(paths.scheduler(i)):
            saved = torch.load(paths.scheduler(i), weights_only=True)
            if isinstance(saved, dict):
                saved.pop(KEY, None)  # the save's label (read_verified checked it), not the scheduler's state
            check_scheduler_state(scheduler.state_dict(), saved, getattr(scheduler, "optimizer", None))
            scheduler.load_state_dict(saved)
    check_scheduler_positions(schedulers, counts, str(paths.root))
