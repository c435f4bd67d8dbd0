"""``mtk.Accelerator``'s ``save_state``/``load_state``: one shard per (tp, pp) rank, written atomically.

A checkpoint (:mod:`mtk.checkpoint.sharded`, or DeepSpeed's state beside mtk's weights) records the
data position across epochs, so ``skip_first_batches`` resumes exactly; loading at another TP, PP or
DP size reshards. accelerate's own conventions are kept: ``automatic_checkpoint_naming`` and
``total_limit``, ``register_for_checkpointing`` objects, and the save/load pre-hooks.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mtk.checkpoint.atomic import holds_checkpoint, removable_checkpoint
from mtk.checkpoint.extras import write_generation_config, write_tokenizer
from mtk.checkpoint.optimizer_checks import check_scheduler_state
from mtk.checkpoint.paths import CheckpointPaths, reading
from mtk.checkpoint.resume import data_position, rescaled_position
from mtk.checkpoint.schedules import follow_the_schedule
from mtk.checkpoint.sharded import load_checkpoint, save_checkpoint
from mtk.errors import CheckpointError, ConfigError
from mtk.integrations.accelerate.shuffle import completed_passes, replay_shuffles
from mtk.integrations.deepspeed import load_deepspeed_checkpoint, save_deepspeed_checkpoint
from mtk.parallel.fsdp import reshard
from mtk.parallel.state import ParallelState

if TYPE_CHECKING:  # the mixin is checked as part of accelerate's Accelerator
    from accelerate import Accelerator as _Host
else:
    _Host = object

__all__ = ["ShardedCheckpointing"]

_AUTOMATIC_NAME = re.compile(r"checkpoint_(\d+)")


def _automatic_checkpoints(root: Path, kept: Callable[[Path], bool] = holds_checkpoint) -> Iterator[tuple[int, Path]]:
    """(index, folder) of the complete mtk checkpoints accelerate's automatic naming wrote under ``root`` (``kept``:
    :func:`~mtk.checkpoint.atomic.removable_checkpoint` for those a rotation may remove)."""
    if not root.is_dir():
        return
    for folder in root.iterdir():
        match = _AUTOMATIC_NAME.fullmatch(folder.name)
        if match and kept(folder):
            yield int(match[1]), folder


class ShardedCheckpointing(_Host):
    """Mixin for :class:`mtk.Accelerator`: accelerate's checkpoint API over mtk's sharded format."""

    parallel: ParallelState
    uses_deepspeed: bool
    micro_batches_seen: int
    completed_steps: int
    checkpoint_tokenizer: Any
    data_stream: dict[str, Any] | None
    _deepspeed_engine: Any

    def _checkpoint_parts(self):
        if len(self._models) != 1:
            raise ValueError(f"save_state/load_state support one prepared model, found {len(self._models)}")
        model = self.unwrap_model(self._models[0])
        optimizers = [getattr(o, "optimizer", o) for o in self._optimizers]
        schedulers = [getattr(s, "scheduler", s) for s in self._schedulers]
        return model, optimizers, schedulers

    def save_state(
        self,
        output_dir: str | None = None,
        safe_serialization: bool = True,
        *,
        writers: Sequence[Callable[[Path], None]] = (),
        **kwargs,
    ) -> str:
        """Write ``output_dir`` atomically. Without one: ``<project_dir>/checkpoints/checkpoint_<i>`` under
        accelerate's ``automatic_checkpoint_naming`` (keeping at most ``total_limit``), else
        ``<project_dir>/checkpoints/step_<completed_steps>``. ``writers`` add files of the caller's (a trainer's
        state) on the main process, inside the checkpoint before it is checksummed and marked complete."""
        if not safe_serialization:
            raise ConfigError("mtk checkpoints are safetensors only; save_state(safe_serialization=False) is refused")
        if kwargs:
            raise ConfigError(f"save_state: {sorted(kwargs)} are accelerate's model-saving options; mtk saves shards")
        automatic = self.project_configuration.automatic_checkpoint_naming
        if output_dir is None and automatic:
            output_dir = self._next_automatic_checkpoint()
        elif output_dir is None:
            output_dir = os.path.join(self.project_dir or ".", "checkpoints", f"step_{self.completed_steps}")
        model, optimizers, schedulers = self._checkpoint_parts()
        reshard(model)  # FSDP2 units an evaluation left gathered: the optimizer's parameters are the sharded ones
        for hook in self._save_model_state_pre_hook.values():  # accelerate's register_save_state_pre_hook
            hook(self._models, [], output_dir)  # no full-model weights list: each rank saves its shard
        data = {
            **data_position(self.micro_batches_seen, self._samples_per_micro_batch()),
            "accelerate_step": self.step,
            "dataloader_iterations": [completed_passes(dl) for dl in self._dataloaders],
            **({"stream": self.data_stream} if self.data_stream is not None else {}),
        }
        writers = [
            *([self._write_tokenizer] if self.checkpoint_tokenizer is not None else []),
            self._write_generation_config,
            self._write_custom_objects,
            *writers,
        ]
        if self.uses_deepspeed:  # DeepSpeed's (partitioned) state inside, mtk's weights beside it
            save_deepspeed_checkpoint(
                output_dir, self._deepspeed_engine, self.parallel, data, schedulers=schedulers, writers=writers
            )
        else:
            save_checkpoint(
                output_dir,
                self.parallel,
                model,
                optimizers,
                schedulers,
                step=self.completed_steps,
                extra_rng={"scaler": self.scaler.state_dict()} if self.scaler is not None else None,
                writers=writers,
                data=data,
            )
        if output_dir is not None and automatic:
            self.project_configuration.iteration += 1
        self.wait_for_everyone()
        return str(output_dir)

    def _next_automatic_checkpoint(self) -> str:
        """accelerate's ``checkpoints/checkpoint_<iteration>``, after removing the oldest complete mtk
        checkpoints beyond ``total_limit`` (nothing else in the folder is touched)."""
        root = Path(self.project_dir or ".") / "checkpoints"
        target = root / f"checkpoint_{self.save_iteration}"
        if target.exists():
            raise CheckpointError(
                f"{target} already exists; set accelerator.project_configuration.iteration to the next free index"
            )
        limit = self.project_configuration.total_limit
        if limit is not None and self.is_main_process:
            ours = sorted(_automatic_checkpoints(root, removable_checkpoint), key=lambda item: item[0])
            for _, folder in ours[: max(len(ours) + 1 - limit, 0)]:
                shutil.rmtree(folder)
        self.wait_for_everyone()
        return str(target)

    def _write_custom_objects(self, directory: Path) -> None:
        for i, obj in enumerate(self._custom_objects):  # accelerate's register_for_checkpointing
            torch.save(obj.state_dict(), CheckpointPaths(directory).custom_object(i))

    def _write_generation_config(self, directory: Path) -> None:
        write_generation_config(self._checkpoint_parts()[0], directory)

    def _write_tokenizer(self, directory: Path) -> None:
        write_tokenizer(self.checkpoint_tokenizer, directory)

    def _samples_per_micro_batch(self) -> int | None:
        """Samples one micro-batch step consumes over all DP replicas (the first prepared loader's)."""
        return getattr(self._dataloaders[0], "total_batch_size", None) if self._dataloaders else None

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs) -> None:
        """Restore a checkpoint written by :meth:`save_state` (same layout) and the data position:
        ``completed_steps``, ``micro_batches_seen`` (resume with ``skip_first_batches``) and ``step``."""
        if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
            root = Path(self.project_dir or ".") / "checkpoints"
            found = sorted(_automatic_checkpoints(root))
            if not found:
                raise CheckpointError(f"no complete checkpoint_<i> under {root} to load")
            input_dir = str(found[-1][1])
        if input_dir is None:
            raise ValueError("load_state needs the checkpoint directory, e.g. ckpts/step_150")
        model, optimizers, schedulers = self._checkpoint_parts()
        reshard(model)
        for hook in self._load_model_state_pre_hook.values():  # accelerate's register_load_state_pre_hook
            hook(self._models, input_dir)
        if self.uses_deepspeed:
            meta = load_deepspeed_checkpoint(input_dir, self._deepspeed_engine, self.parallel, schedulers=schedulers)
        else:
            meta = load_checkpoint(input_dir, self.parallel, model, optimizers, schedulers)
        data = meta.data
        self.completed_steps = meta.step
        self.micro_batches_seen = rescaled_position(data, self._samples_per_micro_batch())
        self.step = data.get("accelerate_step", 0)
        self._rescale_schedulers(meta.topology.dp_size)
        if self.scaler is not None and "scaler" in meta.rng:
            self.scaler.load_state_dict(meta.rng["scaler"])
        for dataloader, iteration in zip(self._dataloaders, data.get("dataloader_iterations", [])):
            if hasattr(dataloader, "set_epoch"):
                dataloader.set_epoch(iteration)
            replay_shuffles(dataloader, iteration)
        for i, obj in enumerate(self._custom_objects):
            path = CheckpointPaths(input_dir).custom_object(i)
            if not path.is_file() and getattr(obj, "absent_from_older_checkpoints", False) and meta.save is None:
                # e.g. a ResumeGuard a script registers since a later version: nothing recorded to compare (every
                # labelled save, the later ones, holds it)
                continue
            if not path.is_file():
                raise CheckpointError(
                    f"{input_dir} holds no {path.name}: it was saved with fewer objects registered with "
                    f"register_for_checkpointing than this run registers ({len(self._custom_objects)})"
                )
            with reading(path):
                saved = torch.load(path, weights_only=True)
                if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):  # (the Trainer's: it is not prepared)
                    check_scheduler_state(obj.state_dict(), saved, obj.optimizer)
                obj.load_state_dict(saved)
        self._follow_the_schedules()

    def _follow_the_schedules(self) -> None:
        """Each schedule's rate at its restored position, as this run's schedule gives it
        (:mod:`mtk.checkpoint.schedules`): the prepared ones and those registered for checkpointing (the
        Trainer's)."""
        registered = [o for o in self._custom_objects if isinstance(o, torch.optim.lr_scheduler.LRScheduler)]
        for scheduler in [*self._schedulers, *registered]:
            follow_the_schedule(scheduler)

    def _rescale_schedulers(self, saved_dp: int) -> None:
        """Prepared schedulers step once per DP replica per optimizer step: after a DP change their
        position is converted to this run's units (the rate then follows from it: :meth:`_follow_the_schedules`).
        A DeepSpeed engine steps its scheduler once per optimizer step, whatever the DP size: left as restored."""
        from accelerate.utils import DeepSpeedSchedulerWrapper

        if saved_dp == self.parallel.dp_size:
            return
        for prepared in self._schedulers:
            if isinstance(prepared, DeepSpeedSchedulerWrapper):
                continue
            if prepared.step_with_optimizer and not prepared.split_batches:
                inner = prepared.scheduler
                if hasattr(inner, "last_epoch"):  # torch's: the steps taken
                    inner.last_epoch = inner.last_epoch * self.parallel.dp_size // saved_dp
                    inner._step_count = inner.last_epoch + 1
                elif hasattr(inner, "last_batch_iteration"):  # DeepSpeed's on a torch optimizer: the steps taken - 1
                    steps = inner.last_batch_iteration + 1
                    inner.last_batch_iteration = steps * self.parallel.dp_size // saved_dp - 1
                else:
                    raise CheckpointError(
                        f"the scheduler {type(inner).__name__} has no position mtk can convert from the checkpoint's "
                        f"dp={saved_dp} to this run's dp={self.parallel.dp_size} (accelerate steps it once per DP "
                        f"replica): resume at dp={saved_dp}, or prepare it with step_scheduler_with_optimizer=False"
                    )
