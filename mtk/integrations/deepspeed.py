"""DeepSpeed next to Megatron tensor parallelism: ZeRO over the data-parallel group only.

The model is converted by the rules first; ``deepspeed.initialize(..., mpu=state)`` then receives the
:class:`ParallelState`, whose Megatron ``mpu`` methods tell ZeRO to partition optimizer state,
gradients (and, at stage 3, parameters) over the DP group, and tell DeepSpeed's gradient clipping
which parameters are TP shards (``tensor_model_parallel``) so the global norm is right.

Checkpoints use mtk's ``step_N/`` layout (one safetensors weights file per (tp, pp) rank, under ZeRO-3 one per
rank holding its partition; RNG, data position, metadata), so ``mtk export`` works on them; DeepSpeed's own state
(ZeRO-partitioned optimizer, scheduler, module) sits inside, in ``step_N/deepspeed/``, and is restored by DeepSpeed
at the same layout. ZeRO-3 also saves its optimizer state in mtk's format, so it resumes at another TP, CP or DP size
(:mod:`mtk.integrations.deepspeed_reshard`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mtk import jsonio
from mtk.checkpoint.base_model import check_adapter_settings, check_base
from mtk.checkpoint.counts import (
    check_engine_state,
    check_learning_rates,
    check_optimizer_steps,
    check_scheduler_positions,
    engine_state_sums,
    optimizer_steps,
)
from mtk.checkpoint.integrity import missing_files_are_one_line, read_verified
from mtk.checkpoint.meta import CheckpointMeta
from mtk.checkpoint.paths import CheckpointPaths
from mtk.checkpoint.reader import ShardedCheckpointReader
from mtk.checkpoint.rng import restore_rng
from mtk.checkpoint.schedules import follow_the_schedule
from mtk.checkpoint.sharded import load_schedulers, restore_streams, save_checkpoint
from mtk.checkpoint.weights import reshard_weights
from mtk.config import ConfigError
from mtk.errors import CheckpointError
from mtk.integrations.deepspeed_batch import BatchSizes, reconcile_batch
from mtk.integrations.deepspeed_reshard import inner_optimizer, load_at_another_layout, save_optimizer_pieces
from mtk.integrations.deepspeed_sections import check_sections, idle_sections
from mtk.parallel.optimizer_updates import check_named_update
from mtk.parallel.parameters import is_expert_parallel
from mtk.parallel.pieces import Piece
from mtk.parallel.record import is_peft_model
from mtk.parallel.state import ParallelState
from mtk.training.entry import peer_failure

__all__ = [
    "check_launcher_config",
    "check_precision",
    "check_sections",
    "optimizer_and_schedule",
    "deepspeed_config",
    "held_elements",
    "initialization_cleanup",
    "load_deepspeed_checkpoint",
    "partition_over_replicas",
    "sums_over_context_parallel",
    "save_deepspeed_checkpoint",
    "sizes_from_config",
    "standalone_environment",
    "zero3_gathered",
    "zero3_whole",
]

_DS_TAG = "state"
_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def standalone_environment(report: Callable[[str], None]) -> None:
    """A script run by plain ``python`` (no ``deepspeed`` launcher) runs as one process: the variables the launcher
    would export for ``--num_gpus 1`` are set here, said in one line. Without them DeepSpeed looks for MPI to find
    its ranks (``ModuleNotFoundError: mpi4py``). Launcher variables already there are left alone."""
    if any(name in os.environ for name in _LAUNCHER_VARIABLES):
        return
    import socket

    with socket.socket() as probe:  # a free port for the one-process group's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    report("mtk: started without the deepspeed launcher: one process (deepspeed --num_gpus N runs N)")


def deepspeed_config(
    path: str | Path,
    dp_size: int,
    *,
    micro_batch_size: int | None = None,
    grad_accum: int | None = None,
    gradient_clipping: float | None = None,
    layout: str = "",
    report: Callable[[str], None] = print,
) -> tuple[dict[str, Any], BatchSizes]:
    """The user's DeepSpeed JSON with its three batch fields reconciled with the flags (see
    :func:`~mtk.integrations.deepspeed_batch.reconcile_batch`: a JSON value a flag overrides is reported
    through ``report``, in one line), and the batch it describes.

    DeepSpeed checks ``train_batch_size`` = micro-batch x accumulation x *data-parallel* size (from the
    mpu), so TP ranks are not counted as replicas.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--deepspeed_config {path} does not exist")
    try:
        config = jsonio.read(path)
    except json.JSONDecodeError as err:
        raise ConfigError(f"--deepspeed_config {path} is not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"--deepspeed_config {path} is not a JSON object")
    check_sections(config, path)
    for line in idle_sections(config, path):
        report(line)
    if "tensor_parallel" in config:
        raise ConfigError(
            f"{path}: 'tensor_parallel' turns on DeepSpeed's own AutoTP; mtk does tensor parallelism: remove it "
            f"and pass --tp N"
        )
    batch, note = reconcile_batch(
        config, dp_size, micro_batch_size=micro_batch_size, accumulation=grad_accum, where=str(path), layout=layout
    )
    if note:
        report(note)
    batch.apply(config)
    if gradient_clipping is not None:
        config["gradient_clipping"] = gradient_clipping
    return config, batch


def check_launcher_config(config: dict[str, Any], path: str | Path, parallel: ParallelState) -> None:
    """What the deepspeed launcher (``examples/run.py``) cannot take from a JSON written for accelerate, one line
    each: an ``"auto"`` clipping (accelerate and the HF Trainer fill it in; DeepSpeed compares it with numbers), an
    optimizer that reads whole tensors next to TP (``"Lamb"``: :mod:`mtk.parallel.optimizer_updates`), and an
    ``"mtk"`` block whose degrees are not the run's (the launcher's come from --tp, --cp, --ep, --etp and the
    environment)."""
    if config.get("gradient_clipping") == "auto":
        raise ConfigError(
            f'{path}: "gradient_clipping": "auto" is filled in by accelerate and the HF Trainer, not under the '
            "deepspeed launcher; give a number (1.0, or 0 for none)"
        )
    block = config.get("optimizer")
    if parallel.tp_size > 1 and isinstance(block, dict) and "type" in block:  # each rank updates its TP shards
        check_named_update(str(block["type"]), _on_rank_zero(parallel))
    for key, field in MTK_BLOCK_KEYS.items():
        asked, mine = sizes_from_config(config).get(field), getattr(parallel, field)
        if asked is not None and asked != mine:
            flag = "--" + field.removesuffix("_size")  # --tp, --cp, --ep, --etp
            raise ConfigError(
                f'{path}: "mtk": {{"{key}": {asked}}} but this run\'s size is {mine} ({flag}, else the '
                f"environment); make them agree or drop the key"
            )


def _on_rank_zero(parallel: ParallelState) -> Callable[[str], None]:
    """A report that prints once, on the job's rank 0."""

    def report(line: str) -> None:
        if parallel.rank == 0:
            print(line, flush=True)

    return report


MTK_BLOCK_KEYS = {  # -> ParallelConfig
    "tensor_parallel_size": "tp_size",
    "context_parallel_size": "cp_size",
    "expert_parallel_size": "ep_size",
    "expert_tensor_parallel_size": "etp_size",
}


def sizes_from_config(config: dict[str, Any]) -> dict[str, int]:
    """The degrees a DeepSpeed JSON asks mtk for, as ``ParallelConfig`` fields: ``"mtk": {"tensor_parallel_size": N,
    "context_parallel_size": M}``; any other key of the block is refused in one line.

    DeepSpeed has no key for an external tensor-parallel degree (its ``tensor_parallel`` block turns on its own
    AutoTP) and takes its sequence-parallel degree from the mpu, and ignores top-level keys it does not know;
    ``accelerate launch`` with ``distributed_type: DEEPSPEED`` exports no ``megatron_lm_config``. So the DeepSpeed
    JSON the accelerate YAML names carries them.
    """
    block = config.get("mtk", {})
    unknown = sorted(set(block) - set(MTK_BLOCK_KEYS))
    if unknown:
        raise ConfigError(f'"mtk": {unknown} is not known; the block takes {sorted(MTK_BLOCK_KEYS)}')
    sizes = {}
    for key, field in MTK_BLOCK_KEYS.items():
        value = block.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f'"mtk": {{"{key}": {value!r}}} must be a positive integer')
        sizes[field] = value
    return sizes


def zero3_gathered(engine) -> Any:
    """Context in which ZeRO-3's partitioned parameters are whole again on each rank (else a no-op)."""
    import deepspeed

    if engine.zero_optimization_stage() == 3:
        return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)
    return contextlib.nullcontext()


def zero3_whole(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Context in which one ZeRO-3-partitioned ``tensor`` is whole on every rank of its DP group (collective
    there); a no-op for any other tensor. Gathering a model one tensor at a time holds one whole at a time."""
    import deepspeed

    if hasattr(tensor, "ds_id"):
        return deepspeed.zero.GatheredParameters([tensor], modifier_rank=None)
    return contextlib.nullcontext()


def held_elements(engine) -> dict[str, int]:
    """Model-state elements this rank holds: its parameters (under ZeRO-3 its partition of each, ``ds_tensor``)
    and its optimizer state (the torch optimizer inside DeepSpeed's steps this rank's partition at ZeRO >= 1).

    What ZeRO's sharding claim is checked against: at TP x DP with ZeRO-3 each rank holds ~1/(tp x dp) of the
    model's parameters (the TP-replicated norms are split by DP only, and DeepSpeed pads each partition)."""
    parameters = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in engine.module.parameters())
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
    state = sum(t.numel() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    return {"parameters": parameters, "optimizer_state": state}


def save_deepspeed_checkpoint(
    directory: str | Path,
    engine,
    parallel: ParallelState,
    data: dict[str, Any],
    *,
    schedulers: Sequence = (),
    writers: Sequence = (),
) -> Path:
    """``directory`` in mtk's layout + DeepSpeed's own state in ``directory/deepspeed``. Collective.

    ``schedulers`` DeepSpeed does not own (a torch scheduler stepped by accelerate) are saved beside
    it; ``writers`` run on rank 0 (e.g. the tokenizer).
    """
    model: nn.Module = engine.module

    def deepspeed_state(tmp: Path, label: str) -> None:  # DeepSpeed's own files carry no label
        # a LoRA model's frozen base is not state: the checkpoint names it (metadata.json's base_model)
        engine.save_checkpoint(str(CheckpointPaths(tmp).deepspeed), tag=_DS_TAG, exclude_frozen_parameters=True)

    # ZeRO-3: each rank writes its own partition of every TP shard (nothing gathered), and its partition of the
    # optimizer state in mtk's format (what a resume at another layout reads), except for a LoRA model, whose
    # frozen base is fingerprinted whole
    piece = _zero3_piece(engine, parallel)
    writers_everywhere: list[Callable[[Path, str], None]] = [deepspeed_state]
    if piece is not None:
        writers_everywhere.append(
            lambda tmp, label: save_optimizer_pieces(engine, piece, tmp, parallel.tp_rank, parallel.pp_rank, label)
        )
    if not schedulers and engine.lr_scheduler is not None:  # run.py's, which DeepSpeed steps: saved as mtk's too
        schedulers = [engine.lr_scheduler]
    # collective: resume checks DeepSpeed's own files against it
    inner = inner_optimizer(engine)
    state = engine_state_sums(inner, _restored_weights(engine))
    with zero3_gathered(engine) if piece is None else contextlib.nullcontext():
        return save_checkpoint(
            directory,
            parallel,
            model,
            [],
            list(schedulers),
            step=engine.global_steps,
            writers=list(writers),
            collective_writers=writers_everywhere,
            data=data,
            engine={"engine": "deepspeed", "zero_stage": engine.zero_optimization_stage()},
            piece=piece,
            engine_state=state,
            engine_optimizers=[inner] if inner is not None else [],  # its steps and learning rates, checked at load
        )


def _restored_weights(engine) -> list[torch.Tensor]:
    """The module weights DeepSpeed restores from its own ``model_states`` files: its trainable parameters at ZeRO-0
    to 2 (this rank's TP shards, replicated over DP). At ZeRO-3 they are the optimizer's partitions, counted there."""
    if engine.zero_optimization_stage() == 3:
        return []
    return [param for param in engine.module.parameters() if param.requires_grad]


def _zero3_piece(engine, parallel: ParallelState) -> Piece | None:
    """This rank's place in ZeRO-3's partitioning of every parameter (its rank in the DP x CP group DeepSpeed splits
    them over); ``None`` at stages 1 and 2 (parameters whole on every rank), for a LoRA model, and where ZeRO-3
    partitions over a subgroup (MiCS: each subgroup would write the same pieces)."""
    if engine.zero_optimization_stage() != 3 or is_peft_model(engine.module):
        return None
    param = next(engine.module.parameters())
    group = param.ds_process_group
    if dist.get_world_size(group=group) != parallel.replica_size:
        return None
    return Piece(dist.get_rank(group=group), parallel.replica_size)


@missing_files_are_one_line
def load_deepspeed_checkpoint(
    directory: str | Path, engine, parallel: ParallelState, *, schedulers: Sequence = ()
) -> CheckpointMeta:
    """Restore DeepSpeed's state, ``schedulers`` (else the engine's own) and mtk's RNG; returns the metadata.

    At the layout that wrote it DeepSpeed restores its own state. A ZeRO-3 checkpoint resumes at another TP, CP or DP
    size under ZeRO-3 from mtk's files (:mod:`mtk.integrations.deepspeed_reshard`); other changes are one line."""
    meta = read_verified(directory)  # collective: every file matches its checksum, or every rank refuses
    paths = CheckpointPaths(directory)
    saved = meta.topology
    if meta.engine != "deepspeed":
        raise CheckpointError(f"{directory} was not written by the DeepSpeed engine; resume it with the same engine")
    check_base(str(directory), meta.base_model, engine.module, parallel)  # collective
    check_adapter_settings(str(directory), meta.model.get("adapters"), engine.module)
    layout = (parallel.tp_size, parallel.pp_size, parallel.dp_size, parallel.cp_size, engine.zero_optimization_stage())
    experts = (parallel.ep_size, parallel.etp_size) == (saved.ep_size, saved.etp_size)  # DeepSpeed's groups by EP
    same = (saved.tp_size, saved.pp_size, saved.dp_size, saved.cp_size, meta.zero_stage) == layout and experts
    if same:
        path = _deepspeed_load(engine, paths, meta)
        if path is None:
            raise CheckpointError(f"{directory}/deepspeed holds no DeepSpeed checkpoint")
        _restore_spread_experts(engine.module, directory, meta, parallel)
    elif meta.zero_stage == 3 and engine.zero_optimization_stage() == 3 and saved.pp_size == parallel.pp_size:
        load_at_another_layout(directory, engine, meta, parallel)
    else:
        raise CheckpointError(
            f"{directory} was written at tp={saved.tp_size} cp={saved.cp_size} pp={saved.pp_size} dp={saved.dp_size} "
            f"{_experts(saved.ep_size, saved.etp_size)}with ZeRO stage {meta.zero_stage}, this run is "
            f"tp={parallel.tp_size} cp={parallel.cp_size} pp={parallel.pp_size} dp={parallel.dp_size} "
            f"{_experts(parallel.ep_size, parallel.etp_size)}with stage {engine.zero_optimization_stage()}; a "
            "DeepSpeed checkpoint resumes at its own layout, or a ZeRO-3 one under ZeRO-3 at another TP, CP or DP "
            "size (export it with `mtk export` to change anything else)"
        )
    if same and engine.global_steps != meta.step:  # DeepSpeed's files count steps too
        raise CheckpointError(
            f"{directory}: DeepSpeed's state counts {engine.global_steps} steps where the metadata says {meta.step}; "
            "its files are from another save (crafted, or mixed from two runs): use another checkpoint"
        )
    inner = inner_optimizer(engine)
    if same:  # and hold the state the save recorded (its files carry no save label)
        check_engine_state(inner, _restored_weights(engine), meta, str(directory), parallel.device)
        _apply_configured_clipping(engine, str(directory))
    # the steps and learning rates the save recorded, from DeepSpeed's files or from mtk's pieces and JSON
    counted = [inner] if inner is not None else []
    check_optimizer_steps(optimizer_steps(counted, parallel.device), meta.counts, str(directory))  # collective
    check_learning_rates(counted, meta.counts, str(directory))
    if not schedulers and engine.lr_scheduler is not None:
        if same:  # DeepSpeed restored it from its own files: at the position the metadata recorded
            check_scheduler_positions([engine.lr_scheduler], meta.counts, str(directory))
        else:
            schedulers = [engine.lr_scheduler]
    load_schedulers(paths, list(schedulers), meta.counts)
    for scheduler in [*schedulers, engine.lr_scheduler]:  # (run.py's is the engine's)
        follow_the_schedule(scheduler)
    meta.rng = restore_rng(paths, meta, parallel)
    restore_streams(engine.module, meta, parallel)  # the per-TP-rank dropout stream
    return meta


def _experts(ep_size: int, etp_size: int | None) -> str:
    return f"ep={ep_size} etp={etp_size} " if ep_size > 1 else ""


def _restore_spread_experts(
    model: nn.Module, directory: str | Path, meta: CheckpointMeta, parallel: ParallelState
) -> None:
    """Under expert parallelism DeepSpeed's own module file holds the weights of one rank of each data-parallel group
    (its experts are registered with DeepSpeed as MoE parameters, whose per-expert files DeepSpeed writes only for its
    own MoE layers): every rank then reads its weights, its experts included, from mtk's files, which hold every
    expert by its global index (their fp32 partitions and moments are DeepSpeed's, one file per rank)."""
    if parallel.ep_size == 1 or not any(is_expert_parallel(p) for p in model.parameters()):
        return
    with ShardedCheckpointReader(directory, meta) as reader, torch.no_grad():
        reshard_weights(model, reader)


def _apply_configured_clipping(engine, where: str) -> None:
    """DeepSpeed's ZeRO 1/2 state restores the gradient clipping it was saved with over this run's
    ``gradient_clipping``: this run's applies, and the difference is said in one line."""
    wrapper: Any = getattr(engine, "optimizer", None)
    saved = getattr(wrapper, "clip_grad", None)
    if saved is None:  # (ZeRO-3's and ZeRO-0's keep none in their state)
        return
    configured = engine.gradient_clipping()
    if float(saved) == float(configured):
        return
    wrapper.clip_grad = configured
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(
            f"mtk: {where} was saved clipping gradients at {saved}; this run's gradient_clipping {configured} applies"
        )


def _deepspeed_load(engine, paths: CheckpointPaths, meta: CheckpointMeta) -> str | None:
    """DeepSpeed's own ``load_checkpoint`` of ``paths.deepspeed`` (where it found its state, or ``None``). Its files
    matched their checksums, so a file it cannot read (cut short, or not its format, with the checksum rewritten) is
    a crafted checkpoint: whatever DeepSpeed raises reading it is one line."""
    try:
        path, _ = engine.load_checkpoint(str(paths.deepspeed), tag=_DS_TAG, load_module_strict=meta.base_model is None)
    except Exception as err:  # noqa: BLE001 (a third party's reader of files from disk: any failure is the file's)
        if peer_failure(err) is not None:  # another rank's failure reached this one's collective: said there
            raise
        message = " ".join(str(err).split())[:300] or type(err).__name__
        raise CheckpointError(
            f"{paths.deepspeed}: DeepSpeed cannot read its state ({type(err).__name__}: {message}); its files are "
            "damaged or crafted, though they match the recorded checksums: use another checkpoint"
        ) from None
    return path


def _shm_buffers(rank: str | None) -> list[Path]:
    """This job's ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` files on this node:
    this rank's, or every local rank's (``rank=None``)."""
    port = os.environ.get("MASTER_PORT")
    if port is None or not Path("/dev/shm").is_dir():
        return []
    return list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_{rank or '*'}"))


def remove_shm_buffers_at_exit() -> None:
    """Unlink this rank's ``/dev/shm/deepspeed_allreduce_buffer_*`` when the process exits.

    On CPU, DeepSpeed's shared-memory all-reduce op creates one buffer file (tens of MiB, in RAM)
    per rank and port and never removes it: a machine that runs many jobs fills ``/dev/shm`` until
    new processes fail to load torch. Unlinking at exit is safe: peers keep their mappings. A launcher
    stops the other ranks of a failed job with SIGTERM, which would end the process without exit
    handlers: unless the script handles SIGTERM itself (mtk's ``ExitSignal``, later), it exits instead.
    """
    rank = os.environ.get("RANK")
    if rank is None:
        return

    def remove() -> None:
        for path in _shm_buffers(rank):
            path.unlink(missing_ok=True)

    exiting: list[bool] = []

    def exit_on_sigterm(signum: int, frame: Any) -> None:
        if exiting:  # inside an exit handler a SystemExit is printed as an ignored exception's traceback
            remove()
            os._exit(128 + signum)
        raise SystemExit(128 + signum)

    atexit.register(remove)
    atexit.register(lambda: exiting.append(True))  # (exit handlers run last-registered first: this one before all)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, exit_on_sigterm)


@contextlib.contextmanager
def initialization_cleanup(where: str) -> Iterator[None]:
    """Around ``deepspeed.initialize``: if it fails (any exception), every local rank's shared-memory
    buffer of this job is unlinked at once, and a config DeepSpeed refuses is one line naming ``where``.

    At-exit removal is not enough there: the launcher kills the other ranks when one fails, and a killed
    rank runs no exit handlers. Once any rank is past DeepSpeed's comm setup, every local rank has created
    its buffer (the setup waits for all of them), so the failing rank can remove them all; the job is over.
    """
    try:
        yield
    except BaseException as err:
        for path in _shm_buffers(None):
            path.unlink(missing_ok=True)
        # DeepSpeed's config checks (pydantic's are ValueErrors), and optimizer params the optimizer it builds from
        # them does not take ("params": {"bogus": 1} is passed on as a keyword)
        unexpected = isinstance(err, TypeError) and "unexpected keyword argument" in str(err)
        if isinstance(err, AssertionError | ValueError) or unexpected:
            message = " ".join(str(err).split()) or type(err).__name__
            raise ConfigError(f"{where}: DeepSpeed refused the config: {message}") from None
        if isinstance(err, RuntimeError) and str(err).startswith("Unable to JIT load the"):  # an op this machine lacks
            message = " ".join(str(err).split()).removesuffix(" None")
            raise ConfigError(
                f"{where}: DeepSpeed cannot build an op the config needs on this machine ({message}); change the "
                "setting that needs it (offload to nvme needs the async_io op and libaio: offload to cpu instead)"
            ) from None
        raise


def sums_over_context_parallel(config: dict[str, Any]) -> bool:
    """Whether DeepSpeed sums the CP ranks' gradients (each rank then backpropagates its share of the tokens) rather
    than averaging them over DP x CP (each rank backpropagates ``cp`` times its share, as under DDP).

    ZeRO 0, 1 and 2 divide by DP only (their sequence-parallel correction: ``world / sp``). ZeRO-3's reduce-scatter,
    its default path, divides by the whole partition group and has no such correction (deepspeed 0.19; measured:
    ``run.py --cp 2`` under ds_configs/zero3.json logged half ZeRO-1's gradient norm, 1.3695 against 2.7391)."""
    return config.get("zero_optimization", {}).get("stage", 0) != 3


def partition_over_replicas(model: nn.Module, config: dict[str, Any], parallel: ParallelState) -> None:
    """Partition ``model``'s parameters for ZeRO-3 over the replica group (DP x CP) before DeepSpeed sees it.

    Why: handed a whole model, DeepSpeed partitions it over the mpu's *data*-parallel group while its ZeRO-3
    optimizer reduces over the sequence-data-parallel one (checked, deepspeed 0.19: ``parameter_offload`` reads
    ``mpu.get_data_parallel_group()``). At CP > 1 each parameter then lives on its DP group only and each CP rank
    steps on the gradient of its own part of the sequence. ``deepspeed.zero.Init(module=...)``, the call DeepSpeed
    itself makes, given the replica group (its documented use under sequence parallelism) places them as the
    optimizer expects; DeepSpeed then finds them converted and keeps the group. At CP = 1 the replica group is the DP
    group and nothing is done here. ZeRO-3's settings that this partitioning does not carry, or whose gradient
    scaling differs at CP, are one line."""
    zero = config.get("zero_optimization", {})
    if parallel.cp_size == 1 or zero.get("stage", 0) != 3:
        return
    where = f"ZeRO-3 with context parallelism (cp = {parallel.cp_size})"
    if zero.get("reduce_scatter", True) is False:  # its all-reduce path divides by DP x CP or by DP, by bucket size
        raise ConfigError(f'{where} needs its reduce-scatter: remove "reduce_scatter": false from the DeepSpeed JSON')
    for key in ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights"):
        if zero.get(key, False) not in (False, 1, None):
            raise ConfigError(f'{where} does not take ZeRO++\'s "{key}" yet; remove it from the DeepSpeed JSON')
    import deepspeed

    deepspeed.zero.Init(
        module=model, data_parallel_group=parallel.replica_group, config_dict_or_path=config, mpu=parallel
    )


def check_precision(config: dict[str, Any], where: str, *, accelerate: bool = False) -> None:
    """One line instead of DeepSpeed's traceback when the config asks for fp16 where DeepSpeed has none
    (a CPU): it says what runs there (bf16, fp32), in the words of the path used (``accelerate``: its
    ``mixed_precision``, which fills the JSON's ``"fp16"`` block)."""
    from deepspeed.accelerator import get_accelerator

    fp16 = config.get("fp16")
    if not isinstance(fp16, dict) or fp16.get("enabled") is not True:
        return
    accelerator = get_accelerator()
    if accelerator.is_fp16_supported():
        return
    if accelerate:
        asked = 'fp16 (mixed_precision fp16, or the JSON\'s "fp16": {"enabled": true})'
        bf16, fp32 = "bf16 (mixed_precision bf16)", 'fp32 (mixed_precision no, "fp16" not enabled)'
    else:
        asked = '"fp16": {"enabled": true}'
        bf16, fp32 = 'bf16 ("bf16": {"enabled": true})', 'fp32 (no fp16 block, or "enabled": false)'
    works = [bf16, fp32] if accelerator.is_bf16_supported() else [fp32]
    raise ConfigError(
        f"{where}: {asked} does not run under DeepSpeed on {accelerator.device_name()} (no fp16 there); "
        f"use {' or '.join(works)}"
    )


DEFAULT_LR = 3e-3  # run.py's learning rate when neither --lr nor the JSON's optimizer gives one


def optimizer_and_schedule(
    config: dict[str, Any], where: str, lr: float | None, report: Callable[[str], None] | None = None
) -> None:
    """Reconcile the JSON's ``optimizer`` and ``scheduler`` with a script that schedules the LR itself (``run.py``:
    warm-up, then linear decay, passed to ``deepspeed.initialize`` as ``lr_scheduler``), in place.

    DeepSpeed takes the JSON's optimizer and ignores a ``--lr`` the script would put in its own, and prefers the
    script's ``lr_scheduler`` to the JSON's ``scheduler`` block: either way one of the two was dropped without a
    word (a JSON lr of 0.5 trained at 0.5 under ``--lr 1e-4``). Here the JSON's lr is used unless ``--lr`` is given,
    which overrides it in one line, as the batch flags do; a ``scheduler`` block is one line (it would not run).
    """
    if "scheduler" in config:
        raise ConfigError(
            f'{where}: its "scheduler" block would be ignored (the script schedules the learning rate itself: '
            "--warmup_steps of linear warm-up, then linear decay to 0 at --max_steps); remove the block"
        )
    optimizer = config.setdefault("optimizer", {"type": "AdamW", "params": {"weight_decay": 0.0}})
    params = optimizer.setdefault("params", {})
    stated = params.get("lr")
    if lr is not None and stated is not None and stated != lr and report is not None:
        report(f"mtk: --lr {lr} overrides optimizer.params.lr {stated} in {where}")
    params["lr"] = lr if lr is not None else stated if stated is not None else DEFAULT_LR
    params.setdefault("torch_adam", True)
