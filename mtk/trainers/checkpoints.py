"""The Trainer's checkpoints on mtk's layout: ``checkpoint-N/`` is mtk's sharded, checksummed checkpoint with the
Trainer's ``trainer_state.json`` inside it, written atomically and resumed at this run's layout (resharded when
TP/PP changed), the RNG restored where the Trainer restores its own; ``save_model`` writes one merged HF directory
(or PEFT's adapter directory) without touching other files in the target. :mod:`mtk.trainers.base` says why."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import transformers.trainer as hf_trainer
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

from mtk.checkpoint.integrity import read_verified
from mtk.checkpoint.paths import CheckpointPaths
from mtk.checkpoint.rng import rng_state, set_rng_state
from mtk.errors import CheckpointError, ConfigError
from mtk.integrations.accelerate import Accelerator
from mtk.integrations.accelerate.save import save_pretrained

__all__ = ["TrainerCheckpointing"]

# Names a saved HF model (or PEFT adapter) directory holds that could clash with folders.
_MODEL_FOLDERS = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "adapter_config.json",
    "adapter_model.safetensors",
)


class TrainerCheckpointing:
    """The checkpoint and save hooks of :class:`~mtk.trainers.base.ParallelTrainerMixin` (a mixin of the Trainer)."""

    accelerator: Accelerator
    args: Any
    model: Any
    state: Any
    control: Any
    callback_handler: Any
    processing_class: Any
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
            if os.path.exists(best):
                self.state.best_model_checkpoint = best
        for callback in [*self.callback_handler.callbacks, self.control]:
            if isinstance(callback, ExportableState):
                name, state = type(callback).__name__, callback.state()
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(state)
                else:
                    self.state.stateful_callbacks[name] = state
        self.accelerator.completed_steps = self.state.global_step  # the step mtk's metadata records
        self.accelerator.save_state(output_dir, writers=[self._write_trainer_state])
        if self.args.should_save:
            hf_trainer.rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    def _write_trainer_state(self, directory: Path) -> None:
        self.state.save_to_json(str(directory / hf_trainer.TRAINER_STATE_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Checked now (one line if it is not a complete mtk checkpoint); loaded once the model is prepared."""
        folder = Path(resume_from_checkpoint)
        if (folder / hf_trainer.TRAINER_STATE_NAME).is_file() and not CheckpointPaths(folder).metadata.is_file():
            raise CheckpointError(
                f"{folder} is a checkpoint of transformers' own Trainer (no mtk metadata.json), which holds one "
                "process's view of the model and optimizer: start from its weights (model=<its directory>) "
                "instead of resuming it"
            )
        read_verified(resume_from_checkpoint)

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
        same names (a previous save's): nothing else there is touched."""
        target = Path(output_dir if output_dir is not None else self.args.output_dir)
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
