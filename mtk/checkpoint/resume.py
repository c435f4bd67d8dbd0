"""Which checkpoint a run starts from: ``--resume PATH``, ``--resume auto``, or a fresh start that must not
mix with an earlier run's checkpoints in the same folder.

A fresh run into an output directory that already holds complete checkpoints would replace some
``step_N`` and leave others, two runs in one folder. So it is refused unless the user says which they
mean: ``--resume auto`` (continue from the newest complete checkpoint, e.g. a requeued job) or
``--overwrite`` (start over; the earlier run's checkpoints, which mtk wrote, are removed first). Two runs at
once in one folder are refused too: the main process locks it first (:mod:`mtk.checkpoint.lock`).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from mtk.checkpoint.atomic import check_ours, check_replaceable, holds_checkpoint, refuse_link
from mtk.checkpoint.lock import lock_output_dir
from mtk.checkpoint.meta import read_metadata
from mtk.data.sources import data_fingerprint
from mtk.data.tokenizers import tokenizer_source
from mtk.errors import CheckpointError

__all__ = [
    "data_position",
    "rescaled_position",
    "AUTO",
    "ResumeGuard",
    "add_resume_arguments",
    "complete_checkpoints",
    "on_main_process",
    "remove_checkpoints",
    "resolve_resume",
    "start_point",
]

AUTO = "auto"


def complete_checkpoints(root: str | Path, prefix: str = "step") -> list[tuple[int, Path]]:
    """``(N, folder)`` of the complete mtk checkpoints ``<prefix>_N`` directly under ``root``, by N."""
    root = Path(root)
    if not root.is_dir():
        return []
    pattern = re.compile(rf"{re.escape(prefix)}_(\d+)")
    found = [
        (int(match[1]), folder)
        for folder in root.iterdir()
        if (match := pattern.fullmatch(folder.name)) and holds_checkpoint(folder)
    ]
    return sorted(found)


def resolve_resume(output_dir: str | Path, resume: str | None, overwrite: bool) -> str | None:
    """The checkpoint to load (``None``: start fresh). Every rank may call it: it only reads.

    Raises:
        CheckpointError: a fresh start (no ``--resume``, no ``--overwrite``) into a folder holding checkpoints.
    """
    existing = complete_checkpoints(output_dir)
    if resume == AUTO:
        return str(existing[-1][1]) if existing else None
    if resume is not None or overwrite or not existing:
        return resume
    names = ", ".join(folder.name for _, folder in existing)
    raise CheckpointError(
        f"--output_dir {output_dir} already holds checkpoints of an earlier run ({names}); pass --resume auto to "
        f"continue it, --overwrite to start over (they are removed), or another --output_dir"
    )


def remove_checkpoints(output_dir: str | Path) -> list[str]:
    """Remove the complete mtk checkpoints ``step_N`` under ``output_dir`` (nothing else); their names."""
    removed, folders = [], [folder for _, folder in complete_checkpoints(output_dir)]
    for folder in folders:  # all checked before any is removed
        refuse_link(folder, "--overwrite removes only the checkpoints mtk wrote here, never through a link")
        check_replaceable(folder)
    for folder in folders:
        shutil.rmtree(folder)
        removed.append(folder.name)
    return removed


def start_point(
    args: argparse.Namespace, *, main_process: bool, barrier: Callable[[], None] = lambda: None
) -> str | None:
    """Resolve ``--resume``/``--overwrite`` (:func:`add_resume_arguments`) and ``--output_dir`` for a training
    script on every rank; returns the checkpoint to load.

    First the main process (rank 0 of the job) locks ``--output_dir`` for the run's lifetime; when another
    run holds it, every rank refuses with the same line before any of them writes. With ``--overwrite`` the
    main process removes the earlier run's checkpoints (and says so) while the others wait at ``barrier``.
    """
    output_dir, resume, overwrite = args.output_dir, args.resume, args.overwrite
    if overwrite and resume is not None:
        raise CheckpointError("--overwrite starts a run over and cannot be combined with --resume; choose one")
    on_main_process(lambda: check_output_place(output_dir, getattr(args, "data", None)), main_process)
    on_main_process(lambda: lock_output_dir(output_dir), main_process)
    start = resolve_resume(output_dir, resume, overwrite)
    if resume == AUTO and main_process:
        found = f"resuming from {start}" if start else f"no checkpoint in {output_dir}, starting fresh"
        print(f"mtk: --resume auto: {found}", flush=True)
    # every refusal before anything is removed: an --overwrite that then refused would have deleted for nothing
    on_main_process(lambda: check_steps_to_write(output_dir, _step_of(start)), main_process)
    if overwrite:
        if main_process and (removed := remove_checkpoints(output_dir)):
            print(f"mtk: --overwrite: removed {', '.join(removed)} of an earlier run in {output_dir}", flush=True)
        barrier()
    return start


def _step_of(checkpoint: str | None) -> int:
    """The step a run resumes from (0: a fresh run): its metadata's. A ``step_N`` whose metadata records another
    step (a copy or a renamed checkpoint) is refused: ``--resume auto`` picks the newest by name, and the run would
    continue from the recorded step, writing below the name it resumed from."""
    if checkpoint is None:
        return 0
    try:
        recorded = read_metadata(checkpoint).step
    except CheckpointError:
        recorded = None  # (loading it says what is wrong)
    match = re.fullmatch(r"step_(\d+)", Path(checkpoint).name)
    if match and recorded is not None and int(match[1]) != recorded:
        raise CheckpointError(
            f"{checkpoint} records step {recorded}, not {match[1]}: a copy or a renamed checkpoint, which --resume "
            f"auto would take for the newest; remove or rename it (step_{recorded}), or resume it explicitly under "
            "another name"
        )
    if match:
        return int(match[1])
    return recorded or 0


def data_position(micro_batches: int, samples_per_micro_batch: int | None) -> dict[str, Any]:
    """What a checkpoint records of where the data stream is (read back by :func:`rescaled_position`): the
    micro-batches consumed, their samples over all DP replicas, and the samples consumed, their product, by which a
    count edited alone (or copied from another save) is told from the record."""
    samples = micro_batches * samples_per_micro_batch if samples_per_micro_batch else None
    return {"micro_batches": micro_batches, "samples_per_micro_batch": samples_per_micro_batch, "samples": samples}


def rescaled_position(data: dict, samples_now: int | None) -> int:
    """Micro-batches a checkpoint consumed (its ``data``: :func:`data_position`), in units of this run's micro-batch
    of ``samples_now`` samples: the DP size or the batch may have changed. A position that falls inside one of this
    run's micro-batches is one line, and so is a record whose counts disagree."""
    seen, per_batch, samples = data.get("micro_batches", 0), data.get("samples_per_micro_batch"), data.get("samples")
    for name, count in (("micro_batches", seen), ("samples_per_micro_batch", per_batch), ("samples", samples)):
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
            raise CheckpointError(
                f"the checkpoint's data position {name} is {count!r}, not a count: not as mtk saved it (crafted, or "
                "damaged); use another checkpoint"
            )
    if per_batch == 0:  # a micro-batch holds a sample at least: 0 would switch the checks below off
        raise CheckpointError(
            "the checkpoint's data position records micro-batches of 0 samples: not as mtk saved it (crafted, or "
            "damaged); use another checkpoint"
        )
    if samples is not None and per_batch and samples != seen * per_batch:  # (recorded since the field exists)
        raise CheckpointError(
            f"the checkpoint's data position disagrees with itself: {seen} micro-batches of {per_batch} samples, "
            f"but {samples} samples consumed; not as mtk saved it (crafted, or damaged): use another checkpoint"
        )
    if not per_batch or not samples_now or per_batch == samples_now:
        return seen
    samples = seen * per_batch
    if samples % samples_now:
        raise CheckpointError(
            f"the checkpoint consumed {samples} samples, not a whole number of this run's {samples_now}-sample steps "
            f"(batch size x data-parallel size); resume with a global batch that divides {samples}"
        )
    return samples // samples_now


_STEP_ENTRY = re.compile(r"step_(\d+)(\.incomplete|\.old)?")


def check_output_place(output_dir: str | Path, data: str | None) -> None:
    """Refuse, before anything is written, an ``--output_dir`` inside a checkpoint (its lock, logs and checkpoints
    would make that checkpoint fail verification and resume) or inside the ``--data`` folder (the data sources
    would then refuse, or read, what the run writes)."""
    target = Path(output_dir).resolve()
    for folder in (target, *target.parents):
        if (folder / "metadata.json").is_file() and (folder / "model").is_dir():
            raise CheckpointError(
                f"--output_dir {output_dir} is inside the checkpoint {folder}; the run writes its lock, logs and "
                "checkpoints there: choose a folder outside it"
            )
    if data is None or not Path(data).is_dir():
        return
    source = Path(data).resolve()
    if target == source or source in target.parents:
        raise CheckpointError(
            f"--output_dir {output_dir} is inside the --data folder {data}; the run would write its logs and "
            "checkpoints among the data files: choose a folder outside it"
        )


def check_steps_to_write(output_dir: str | Path, after: int) -> None:
    """Refuse, before training, what a save of a step past ``after`` would refuse only once reached: a link named as
    its checkpoint or side directory, a side directory mtk did not create, or a ``step_N`` that is not a checkpoint
    (the run's compute up to that save would be lost)."""
    root = Path(output_dir)
    if not root.is_dir():
        return
    logs = root / "runs"  # where the trackers (tensorboard) write
    if logs.exists() and not logs.is_dir():
        raise CheckpointError(
            f"{logs} is a file; the run logs into the folder runs/ of --output_dir: move the file, or choose another "
            "--output_dir"
        )
    for entry in sorted(root.iterdir()):
        match = _STEP_ENTRY.fullmatch(entry.name)
        if not match or int(match[1]) <= after:
            continue
        refuse_link(entry, "a save of this run would write there, and mtk never writes through a link")
        if match[2]:
            check_ours(entry)
        else:
            check_replaceable(entry)


def on_main_process(check: Callable[[], Any], main_process: bool) -> None:
    """Run ``check`` on the main process; its refusal, if any, is raised on every rank."""
    refusal = None
    if main_process:
        try:
            check()
        except CheckpointError as err:
            refusal = str(err)
    if dist.is_available() and dist.is_initialized():  # the main process is rank 0 (accelerate's, DeepSpeed's)
        shared = [refusal]
        dist.broadcast_object_list(shared, src=0)
        refusal = shared[0]
    if refusal:
        raise CheckpointError(refusal)


def add_resume_arguments(parser: argparse.ArgumentParser, example: str = "ckpts/step_20") -> None:
    """``--resume`` (a checkpoint or ``auto``) and ``--overwrite``, as every training script spells them."""
    parser.add_argument(
        "--resume", help=f"checkpoint to resume from, e.g. {example}, or 'auto': the newest in --output_dir"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in an --output_dir that holds an earlier run's checkpoints",
    )


class ResumeGuard:
    """The options a resumed run must share with the run it continues, checked when it resumes.

    Some decide which data comes next (``--data``, ``--seq_len`` or classify.py's ``--max_length``, ``--seed``,
    ``--model``, ``--tokenizer``, packing): changing one on resume would silently train on a different stream than
    the checkpoint's data position means (another tokenizer also gives the same ids other meanings). Others
    decide what the checkpoint's adapters are (``--lora_*``, ``--base_dtype``): a LoRA checkpoint resumed with
    another alpha or targets would silently train another model. Registered with accelerate's
    ``register_for_checkpointing``, so it is saved in every checkpoint and compared by ``load_state``; a change is
    one line naming the option. Paths are compared as the files they name (``dir/`` and ``./dir`` are ``dir``),
    and ``--data``'s files by their contents too (:func:`~mtk.data.sources.data_fingerprint`): rows appended to the
    same file would otherwise shift every position after the checkpoint's without a word.
    """

    # checkpoints written before a script registered a guard have none: they resume, unchecked, as before
    absent_from_older_checkpoints = True
    # the scripts' options that decide which data comes next
    DATA_OPTIONS = ("model", "tokenizer", "data", "seq_len", "max_length", "seed", "packing", "loss_on")
    # the options that decide what the trained model is (the adapters' settings are compared as PEFT configs, on
    # every path: mtk.checkpoint.base_model.check_adapter_settings; --lora_* flags compared as typed refused the
    # same adapters written another way, --lora_targets v_proj,q_proj against q_proj,v_proj)
    MODEL_OPTIONS = ("base_dtype",)
    _PATHS = ("model", "tokenizer", "data")
    _CONTENTS = "data_contents"  # not an option: the digest of --data's files
    _MODEL_CONFIG = "model_config"  # not an option: --model's config.json as it was (a directory's, or the file)

    def __init__(self, **options: Any) -> None:
        self.options = _as_read(options)

    @classmethod
    def from_args(cls, args: argparse.Namespace, data_format: str | None = None) -> ResumeGuard:
        """The guard of a training script's parsed options (those of the two lists it has). ``data_format``: that
        of ``--data`` (formats.detect_format); on plain ``text`` rows ``--loss_on`` changes nothing, so it is not
        guarded there."""
        names = (*cls.DATA_OPTIONS, *cls.MODEL_OPTIONS)
        unused = ("loss_on",) if data_format == "text" else ()
        options = {name: getattr(args, name) for name in names if hasattr(args, name) and name not in unused}
        if isinstance(options.get("data"), str) and Path(options["data"]).exists():
            options[cls._CONTENTS] = _shared_fingerprint(options["data"])
        model = Path(options["model"]) if isinstance(options.get("model"), str) else None
        config = model if model is not None and model.is_file() else model / "config.json" if model else None
        if config is not None and config.is_file():  # the same directory (or file) with another architecture
            options[cls._MODEL_CONFIG] = hashlib.sha256(config.read_bytes()).hexdigest()
        return cls(**options)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.options)

    def _digest_differs(self, saved: dict[str, Any], key: str) -> bool:
        """Whether the checkpoint recorded another digest ``key`` (one that recorded none says nothing)."""
        return saved.get(key, self.options.get(key)) != self.options.get(key)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        saved = _as_read(saved)
        # a checkpoint from before an option was guarded says nothing about it: nothing to compare
        changed = [
            f"--{key} {saved[key]} -> {value}"
            for key, value in self.options.items()
            if saved.get(key, value) != value and key not in (self._CONTENTS, self._MODEL_CONFIG)
        ]
        if not changed and self._digest_differs(saved, self._MODEL_CONFIG):
            raise CheckpointError(
                f"this run's --model {self.options.get('model')} has another config.json than when the checkpoint it "
                f"resumes was written (its architecture or routing changed); resume with the model as it was, or "
                f"start a new run in another --output_dir"
            )
        if not changed and self._digest_differs(saved, self._CONTENTS):
            raise CheckpointError(
                f"this run changes the files of --data {self.options.get('data')} (rows added, removed or edited) "
                f"since the checkpoint it resumes was written, so its data position would point elsewhere; resume "
                f"with the data as it was, or start a new run in another --output_dir"
            )
        if changed:
            raise CheckpointError(
                f"this run changes {', '.join(changed)} from the checkpoint it resumes, which would continue on "
                f"different data or another model; resume with the same options, or start a new run in another "
                f"--output_dir"
            )


def _shared_fingerprint(path: str) -> str:
    """:func:`~mtk.data.sources.data_fingerprint` read once, by rank 0, and given to every rank (collective when a
    process group exists): the ranks compare the same digest, and the data is read once, not once per rank."""
    digest = [data_fingerprint(path) if not dist.is_initialized() or dist.get_rank() == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(digest, src=0)
    return str(digest[0])


def _as_read(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` as what they make the script read: the tokenizer as the one it reads (no ``--tokenizer`` and
    ``--tokenizer bytes`` on a built-in config are one tokenizer), each path as the file it names."""
    options = dict(options)
    if "tokenizer" in options and "model" in options:
        options["tokenizer"] = tokenizer_source(options["model"], options["tokenizer"])
    return {key: _normalized(value) if key in ResumeGuard._PATHS else value for key, value in options.items()}


def _normalized(value: Any) -> Any:
    """A path option as the file it names (absolute, no trailing slash) when it exists; any other value as is."""
    if isinstance(value, str) and value and Path(value).exists():
        return str(Path(value).resolve())
    return value
