"""The Trainer's checkpoints on mtk's layout: ``checkpoint-N/`` is mtk's sharded, checksummed checkpoint with the
Trainer's ``trainer_state.json`` inside it, written atomically and resumed at this run's layout (resharded when
TP/PP changed), the RNG restored where the Trainer restores its own; ``save_model`` writes one merged HF directory
(or PEFT's adapter directory) without touching other files in the target. :mod:`mtk.trainers.base` says why."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import datasets
import transformers.trainer as hf_trainer
from tqdm.auto import tqdm
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, sort_checkpoints

from mtk.checkpoint.atomic import holds_checkpoint, removable_checkpoint
from mtk.checkpoint.integrity import read_verified
from mtk.checkpoint.lock import lock_output_dir
from mtk.checkpoint.meta import read_metadata
from mtk.checkpoint.paths import CheckpointPaths
from mtk.checkpoint.resume import check_output_place, on_main_process
from mtk.checkpoint.rng import rng_state, set_rng_state
from mtk.data.sources import rows_digest
from mtk.errors import CheckpointError, ConfigError
from mtk.integrations.accelerate import Accelerator
from mtk.integrations.accelerate.save import save_pretrained

__all__ = ["TrainerCheckpointing", "claim_output_dir", "rotate_checkpoints", "written_checkpoints"]

_CHECKPOINT = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-\d+")

# Names a saved HF model (or PEFT adapter) directory holds that could clash with folders.
_MODEL_FOLDERS = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "adapter_config.json",
    "adapter_model.safetensors",
)


def claim_output_dir(output_dir: str, resume: str | bool | None, *, main_process: bool) -> str | None:
    """The Trainer's ``output_dir`` for this run alone, and the checkpoint it resumes (``None``: a fresh run).

    The main process locks the folder for the run's lifetime (:func:`~mtk.checkpoint.lock.lock_output_dir`: a
    second run there is one line). A fresh run into a folder holding ``checkpoint-N`` folders is refused: the
    Trainer would replace the earlier run's checkpoints of the same steps, keep its later ones beside this run's
    (``resume_from_checkpoint=True`` would then take another run's newest) and rotate them away with its own.
    ``True`` is resolved to the newest ``checkpoint-N`` here, and the checkpoint must be one the Trainer under mtk
    wrote (mtk's metadata and the Trainer's state): each other kind is one line, not a library's traceback.
    Every rank calls it: the main process's checks are broadcast, and each rank reads the same folder alike.
    """
    on_main_process(lambda: check_output_place(output_dir, None), main_process)  # a refusal is every rank's
    on_main_process(lambda: lock_output_dir(output_dir), main_process)
    folder = Path(output_dir)
    if isinstance(resume, str) and resume.lower() in ("true", "false", "none", "") and not Path(resume).is_dir():
        resume = {"true": True}.get(resume.lower())  # a script's --resume_from_checkpoint True (kept as text)
    if resume is True:
        newest = _newest_checkpoint(folder)
        if newest is None:
            raise CheckpointError(
                f"resume_from_checkpoint=True, but output_dir {output_dir} holds no checkpoint-N to resume; leave it "
                "unset to start a fresh run"
            )
        resume = newest
    if resume is None or resume is False:
        earlier = sorted(
            (entry.name for entry in folder.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if _CHECKPOINT.fullmatch(entry.name)),
            key=lambda name: int(name.rsplit("-", 1)[1]),
        )
        ours = [name for name in earlier if holds_checkpoint(folder / name) and not (folder / name).is_symlink()]
        if ours:
            raise CheckpointError(
                f"output_dir {output_dir} already holds {', '.join(ours)} of an earlier run, which this run would "
                "replace or rotate away; continue it with resume_from_checkpoint (True, or the path of its newest "
                "checkpoint-N), or pass another output_dir"
            )
        if earlier:  # (another tool's folders of the name: nothing of mtk's to resume)
            raise CheckpointError(
                f"output_dir {output_dir} holds {', '.join(earlier)}, which no mtk Trainer wrote (no mtk metadata in "
                "it), where this run would write its checkpoint-N folders; move them away, or pass another output_dir"
            )
        _refuse_a_model_there(folder)
        return None
    checkpoint = Path(str(resume))
    if checkpoint.resolve().parent != folder.resolve():  # (a model beside its checkpoint-N is the lineage's save)
        _refuse_a_model_there(folder)
    has_state = (checkpoint / hf_trainer.TRAINER_STATE_NAME).is_file()
    has_metadata = CheckpointPaths(checkpoint).metadata.is_file()
    if has_state and not has_metadata and not _hf_weights(checkpoint):  # (mtk keeps its shards under model/)
        raise CheckpointError(
            f"{checkpoint} is incomplete: it has trainer_state.json but no metadata.json (an interrupted save, or a "
            f"file removed); resume an earlier checkpoint-N (resume_from_checkpoint=<its path>)"
        )
    if has_state and not has_metadata:
        raise CheckpointError(
            f"{checkpoint} is a checkpoint of transformers' own Trainer (no mtk metadata.json), which holds one "
            "process's view of the model and optimizer: start from its weights (model=<its directory>) instead of "
            "resuming it"
        )
    if has_metadata and not has_state and hf_trainer.TRAINER_STATE_NAME in read_metadata(checkpoint).files:
        raise CheckpointError(
            f"{checkpoint} is incomplete: the trainer_state.json its metadata.json lists is missing; resume an "
            f"earlier checkpoint-N (resume_from_checkpoint=<its path>)"
        )
    if has_metadata and not has_state:
        raise CheckpointError(
            f"{checkpoint} is an mtk checkpoint of a training script (finetune.py, run.py: no trainer_state.json), "
            f"not a Trainer's checkpoint-N: resume it with the script that wrote it, or start the Trainer from its "
            f"weights (mtk export {checkpoint} DIR, then model=DIR)"
        )
    if not has_metadata:
        if not checkpoint.exists():
            raise CheckpointError(
                f"resume_from_checkpoint={resume} does not exist; give a checkpoint-N folder, or True for the newest "
                "in output_dir"
            )
        newest = _newest_checkpoint(checkpoint)
        hint = f" (its newest checkpoint is {newest})" if newest else ""
        if str(resume).lower() in ("true", "false", "none"):  # a folder of that name exists: the word is a path
            hint += f" (read as the folder {checkpoint.resolve()}, which exists: rename it to use the word)"
        raise CheckpointError(
            f"resume_from_checkpoint={resume}: not a checkpoint-N the Trainer wrote{hint}; give a checkpoint-N "
            "folder, or True for the newest in output_dir"
        )
    return str(checkpoint)


def _hf_weights(folder: Path) -> bool:
    """Whether ``folder`` holds weights as transformers' own Trainer saves them (beside its trainer_state.json):
    files, or under ZeRO-3 only DeepSpeed's ``global_stepN/`` and under FSDP ``pytorch_model_fsdp_0/``."""
    patterns = ("*.safetensors", "*.bin", "global_step*/", "pytorch_model_fsdp_*")
    return any(any(folder.glob(pattern)) for pattern in patterns)


# What save_model writes into output_dir beside the weights (*.safetensors; *.bin a PEFT or older save's): the
# model's and generation configs, PEFT's adapter config, and the tokenizer's files of every kind transformers saves.
_SAVED_NAMES = (
    "config.json",
    "generation_config.json",
    "adapter_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
)


def _refuse_a_model_there(folder: Path) -> None:
    """One line where ``folder`` already holds a model (a base model given as ``output_dir`` too, an earlier run's
    save) that is not this run's lineage's: ``save_model`` writes the trained model into ``output_dir`` by the same
    file names, which would replace it."""
    if not folder.is_dir():
        return
    found = sorted(
        entry.name
        for entry in folder.iterdir()
        if entry.name in _SAVED_NAMES or entry.name.endswith((".safetensors", ".bin"))
    )
    if found:
        raise CheckpointError(
            f"output_dir {folder} already holds a model or tokenizer ({', '.join(found[:3])}), which this run's "
            "save_model would replace: pass another output_dir (or move those files out)"
        )


def _newest_checkpoint(folder: Path) -> str | None:
    """The newest ``checkpoint-N`` in ``folder`` that holds an mtk checkpoint (``resume_from_checkpoint=True``):
    transformers' ``get_last_checkpoint`` takes the highest N, another tool's folder of that name included."""
    found = [
        (int(entry.name.rsplit("-", 1)[1]), entry)
        for entry in (folder.iterdir() if folder.is_dir() else ())
        if _CHECKPOINT.fullmatch(entry.name) and not entry.is_symlink() and holds_checkpoint(entry)
    ]
    return str(max(found)[1]) if found else None


def written_checkpoints(output_dir: str, *args: Any, **kwargs: Any) -> list[str]:
    """transformers' ``sort_checkpoints`` (same arguments), keeping only the checkpoints the Trainer under mtk wrote
    (mtk's metadata inside, not through a link): what the Trainer may remove. Its own rotation, and its clean-up at
    the end of ``train()`` (``save_total_limit=1`` with a best checkpoint), removed every ``checkpoint-*`` folder,
    a user's of that name included; the latter reads this through the trainer module's name for the call."""
    return [
        folder
        for folder in sort_checkpoints(output_dir, *args, **kwargs)
        if not Path(folder).is_symlink() and removable_checkpoint(Path(folder))
    ]


def rotate_checkpoints(run_dir: str, limit: int | None, best: str | None) -> None:
    """transformers' rotation (keep the newest ``limit`` checkpoints, the newest and the best always), over
    :func:`written_checkpoints` only."""
    if not limit or limit <= 0:
        return
    written = written_checkpoints(run_dir, use_mtime=True)
    protected = {written[-1]} if written else set()
    if best is not None:
        protected.add(str(Path(best)))
    surplus = len(written) - max(limit, len(protected))
    for folder in [f for f in written if f not in protected][: max(surplus, 0)]:
        shutil.rmtree(folder, ignore_errors=True)


class TrainerCheckpointing:
    """The checkpoint and save hooks of :class:`~mtk.trainers.base.ParallelTrainerMixin` (a mixin of the Trainer)."""

    accelerator: Accelerator
    args: Any
    model: Any
    state: Any
    control: Any
    callback_handler: Any
    processing_class: Any
    train_dataset: Any
    hp_search_backend: Any
    _resumed_rng: dict[str, Any] | None = None

    def _saveable_tokenizer(self) -> Any:
        """The processing class's tokenizer (a processor's own), if it can be saved."""
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        return tokenizer if hasattr(tokenizer, "save_pretrained") else None

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """``checkpoint-N/``: mtk's sharded checkpoint with the Trainer's state inside it, written atomically."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()  # type: ignore[attr-defined]
        run_dir = self._get_output_dir(trial=trial)  # type: ignore[attr-defined]
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        saved_best = (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
        if self.args.save_strategy in saved_best and self.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if self.state.best_global_step == self.state.global_step or os.path.exists(best):
                self.state.best_model_checkpoint = best  # (this step's: written below, the state inside it)
        for callback in [*self.callback_handler.callbacks, self.control]:
            if isinstance(callback, ExportableState):
                name, state = type(callback).__name__, callback.state()
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(state)
                else:
                    self.state.stateful_callbacks[name] = state
        self.accelerator.completed_steps = self.state.global_step  # the step mtk's metadata records
        self.accelerator.save_state(output_dir, writers=[self._write_trainer_state])
        if self.args.push_to_hub:  # (mtk.trainers.hub: the merged model is written and pushed, as transformers')
            self._push_from_checkpoint(output_dir)  # type: ignore[attr-defined]
        if self.args.should_save:
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint)

    def _write_trainer_state(self, directory: Path) -> None:
        self.state.save_to_json(str(directory / hf_trainer.TRAINER_STATE_NAME))

    def _record_data_stream(self, checkpoint: str | None) -> None:
        """Record in each checkpoint what decides the rows its data position counts through, and check a resumed
        run's against it: the training rows as the trainer reads them (after its tokenizing, truncating and
        packing: :func:`~mtk.data.sources.rows_digest`), the global batch and the settings of their order. The
        Trainer resumes by skipping the checkpoint's steps x accumulation batches of whatever data this run has:
        other data, another ``max_length`` or ``packing``, another global batch or seed would skip other rows and
        train on a stream the checkpoint never saw, without a word; an order drawn from the global random state
        when an epoch starts (``group_by_length``, an unseeded sampler) is not reproduced by a resume at all.
        ``ignore_data_skip`` (start the data from its beginning) is the way to resume on other data. A dataset that
        is not a ``datasets.Dataset`` (an iterable one, a torch one) records nothing."""
        dataset, args = self.train_dataset, self.args
        if not isinstance(dataset, datasets.Dataset) or (checkpoint is None and args.save_strategy == "no"):
            return
        stream = {
            "rows": len(dataset),
            "digest": rows_digest(dataset),
            # rows per optimizer step: the Trainer skips the checkpoint's steps x accumulation batches of this size
            "global_batch": args.per_device_train_batch_size
            * args.gradient_accumulation_steps
            * (1 if self.accelerator.split_batches else self.accelerator.parallel.dp_size),  # (split: the whole)
            "order_seed": args.data_seed if args.data_seed is not None else args.seed,
            "train_sampling_strategy": str(args.train_sampling_strategy),
            "dataloader_drop_last": args.dataloader_drop_last,
            # (an unseeded order cannot be continued by a seeded one either)
            "seedable_sampler": bool(getattr(args.accelerator_config, "use_seedable_sampler", True)),
        }
        self.accelerator.data_stream = stream
        # (its metadata alone: the files are verified as the checkpoint is loaded)
        recorded = read_metadata(checkpoint).data.get("stream") if checkpoint is not None else None
        if recorded is None or args.ignore_data_skip:  # (a checkpoint from before mtk recorded it: unchecked)
            return
        advice = (
            "resume with the data and settings it was trained with, or set ignore_data_skip to train this run's data "
            "from its start"
        )
        seedable = stream["seedable_sampler"] and recorded.get("seedable_sampler", True)
        unseeded = {
            "group_by_length": "train_sampling_strategy group_by_length (transformers' LengthGroupedSampler)",
            "random": None if seedable else "accelerator_config use_seedable_sampler false (torch's RandomSampler)",
        }.get(stream["train_sampling_strategy"])
        if unseeded is not None:
            raise CheckpointError(
                f"{unseeded} draws the data order from the global random state when an epoch starts, which a resumed "
                f"run does not reproduce: resuming {checkpoint} at its data position would train on other rows; set "
                f"ignore_data_skip to train the data from its start, or resume a run trained with seedable random "
                f"sampling (the default)"
            )
        if (recorded.get("rows"), recorded.get("digest")) != (stream["rows"], stream["digest"]):
            raise CheckpointError(
                f"this run's training rows ({stream['rows']}) are not those of the checkpoint it resumes "
                f"({checkpoint}: {recorded.get('rows')}), after the trainer's preprocessing (other data, or another "
                f"max_length, packing, template, ...): its data position would skip other rows; {advice}"
            )
        if stream["train_sampling_strategy"] == "sequential":  # (no seed draws the order)
            recorded = {**recorded, "order_seed": stream["order_seed"]}
        if stream["rows"] % stream["global_batch"] == 0:  # (nothing to drop)
            recorded = {**recorded, "dataloader_drop_last": stream["dataloader_drop_last"]}
        shown = {
            "order_seed": "the data order's seed (data_seed, else seed)",
            "global_batch": "the global batch (per_device_train_batch_size x gradient_accumulation_steps x "
            "data-parallel replicas, unless split_batches)",
        }
        changed = [
            f"{shown.get(key, key)} {recorded[key]} -> {new}"
            for key, new in stream.items()
            if recorded.get(key, new) != new
        ]
        if changed:
            raise CheckpointError(
                f"this run changes {', '.join(changed)} of the checkpoint it resumes ({checkpoint}), which decide "
                f"which rows its data position counts through; {advice}"
            )

    def _init_training_state(
        self, max_steps: int, steps_per_epoch: int, epochs: int, checkpoint: str | None, trial: Any
    ) -> tuple[int, int]:
        """The Trainer's, and a checkpoint at ``max_steps`` (a requeued job that had finished) trains nothing: the
        loop checks ``max_steps`` only after a step, so where ``max_steps`` does not end an epoch it trained a step
        more, wrote ``checkpoint-N+1`` and the script's ``save_model`` replaced the final model with it, exit 0. The
        checkpoint is still loaded, so what the script saves after ``train()`` is the finished run's model."""
        position = super()._init_training_state(  # type: ignore[misc]
            max_steps, steps_per_epoch, epochs, checkpoint, trial
        )
        if checkpoint is None or self.state.global_step < max_steps:
            return position
        if self.state.global_step > max_steps:  # (max_steps from the epochs: what train() could not check before)
            raise ConfigError(
                f"{checkpoint} is at step {self.state.global_step}, past this run's {max_steps} steps "
                f"(num_train_epochs {self.args.num_train_epochs:g}): nothing is left to train; give more epochs or "
                "max_steps"
            )
        if self.accelerator.is_main_process:
            tqdm.write(
                f"mtk: {checkpoint} is at step {self.state.global_step}, max_steps {max_steps}: "
                "nothing is left to train"
            )
        return epochs, 0  # (the loop runs no epoch)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Checked now (one line if it is not a complete mtk checkpoint); loaded once the model is prepared."""
        read_verified(resume_from_checkpoint)

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best ``checkpoint-N`` read back through mtk's reader (resharded to this
        layout), its whole state as the run stood at that step, as transformers loads a DeepSpeed run's. transformers'
        own looks for ``model.safetensors`` in the folder, which mtk's checkpoint does not hold: it logged that it
        could not find the best model and kept the last step's weights, which ``save_model`` then wrote."""
        best = self.state.best_model_checkpoint
        if self.accelerator.is_main_process:  # (below the Trainer's progress bar, not appended to it)
            tqdm.write(f"mtk: loading the best model from {best} (score: {self.state.best_metric})")
        self.accelerator.load_state(best)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Weights, optimizer, scheduler, scaler and RNG from mtk's checkpoint, resharded to this layout."""
        if checkpoint is None:
            return
        self.accelerator.load_state(checkpoint)
        self._resumed_rng = rng_state({})  # restored again where the Trainer restores RNG (after skipping)

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Restored by :meth:`_load_optimizer_and_scheduler` (mtk's checkpoint holds the TP-aware scaler)."""

    def _save_rng_state(self, output_dir: str) -> None:
        """Saved by :meth:`_save_checkpoint` (every rank's RNG and TP stream are in mtk's checkpoint)."""

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is not None and self._resumed_rng is not None:
            set_rng_state(self._resumed_rng)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """One merged HF safetensors directory (and the tokenizer) that ``from_pretrained`` loads, or for a LoRA run
        PEFT's adapter directory (``adapter_config.json``, full adapter tensors) that ``PeftModel.from_pretrained``
        loads on the base; collective.

        Into a directory that already holds files (the Trainer's output directory, with its checkpoints and logs)
        the model is written whole beside them first, then its files are moved in, replacing only files of the
        same names (a previous save's): nothing else there is touched. With ``push_to_hub`` it is then pushed, as
        transformers' ``save_model`` pushes (:mod:`mtk.trainers.hub`)."""
        self._write_model(Path(output_dir if output_dir is not None else self.args.output_dir))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)  # type: ignore[attr-defined]

    def _write_model(self, target: Path) -> None:
        tokenizer = self._saveable_tokenizer()
        if not (target.is_dir() and any(target.iterdir())):
            save_pretrained(self.accelerator, self.model, target, tokenizer)
            return
        blocking = [name for name in _MODEL_FOLDERS if (target / name).is_dir()]
        if blocking:
            raise ConfigError(f"save_model: {target / blocking[0]} is a directory; save into a new directory")
        staged = target / f".mtk-save-model-{self.state.global_step}.incomplete"
        save_pretrained(self.accelerator, self.model, staged, tokenizer)
        if self.accelerator.is_main_process:
            for item in sorted(staged.iterdir()):
                os.replace(item, target / item.name)
            staged.rmdir()
        self.accelerator.wait_for_everyone()
