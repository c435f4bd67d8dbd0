"""transformers' ``Trainer`` on mtk's layout: what changes when its processes are TP x PP x DP instead of replicas.

The Trainer builds its ``Accelerator`` itself, so :class:`ParallelTrainerMixin` has it build ``mtk.Accelerator``
(same arguments; the layout comes from the accelerate config's ``megatron_lm_config`` or the DeepSpeed JSON's
``"mtk"`` block) and converts the model right after, before any optimizer, fused head or PEFT adapter sees its
parameters (a TRL trainer's ``peft_config`` adapters are added to the converted model there:
:mod:`mtk.trainers.adapters`; a model TRL was given as a directory, built on the meta device, has this rank's
slices read into it there: :mod:`mtk.trainers.model_path`). The rest follows from what the Trainer assumes about
its processes:

- **Sizes.** The Trainer divides the world by :meth:`get_tp_size` to find its data-parallel size (the batch
  size it logs, the ``x DP`` it multiplies a token-weighted loss by); under mtk every TP and PP rank of a
  replica shares its batch, and so do the CP ranks that split its sequences, so that divisor is
  ``tp x pp x cp``. mtk's ``gather`` already spans only the data-parallel ranks, so the token count of a step
  is not divided again (:meth:`_get_num_items_in_batch`).
- **Pipelines.** A pipelined model runs its backward inside its forward, so the factor the Trainer applies to
  the loss afterwards (``x DP`` for token-weighted losses, ``/ accumulation`` otherwise) is handed to it before
  (:meth:`training_step`).
- **Checkpoints.** ``checkpoint-N/`` is mtk's sharded, checksummed checkpoint (each rank's weights, optimizer,
  RNG and TP dropout stream; the scheduler; the tokenizer) with the Trainer's ``trainer_state.json`` inside it,
  written atomically; resuming loads it at this run's layout (resharding when TP/PP changed) and restores the
  RNG where the Trainer restores its own, after the skipped batches. With LoRA the checkpoint holds the adapters
  and their optimizer state only. ``save_model`` writes one merged HF safetensors directory, or with LoRA PEFT's
  adapter directory (full adapter tensors) that ``PeftModel.from_pretrained`` loads.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import transformers.trainer as hf_trainer
from transformers.trainer_utils import speed_metrics as _speed_metrics

from mtk.errors import ConfigError, library_refusals, process_group_start
from mtk.integrations.accelerate import Accelerator
from mtk.parallel.record import hf_model
from mtk.parallel.state import default_device
from mtk.pipeline.engine import PipelineModel
from mtk.rules.lm_head import logits_mode
from mtk.trainers.adapters import add_adapters, refuse_peft_model
from mtk.trainers.arguments import (
    check_training_arguments,
    clipping_report,
    jit_checkpoint_report,
    recompute_settings,
)
from mtk.trainers.checkpoints import TrainerCheckpointing, claim_output_dir, written_checkpoints
from mtk.trainers.deepspeed_setup import (
    check_deepspeed_json,
    deepspeed_init_in_one_line,
    deepspeed_processes_on_cpu,
    derive_global_batch,
    fill_launchers_deepspeed_config,
    refuse_deepspeed_disagreements,
    refuse_replaced_choices,
)
from mtk.trainers.hub import TrainerHub
from mtk.trainers.model_path import PathLoader
from mtk.trainers.positions import check_batch_positions, learned_positions
from mtk.trainers.signals import EvaluationStopsOnSignal, SaveAndStopOnSignal
from mtk.training.signals import ExitSignal

__all__ = ["ParallelTrainerMixin"]


def _mtk_accelerator(**kwargs: Any) -> Accelerator:
    """``mtk.Accelerator`` from the arguments the Trainer passes accelerate's (``None`` meaning "not used")."""
    for key in ("deepspeed_plugin", "fsdp_plugin", "parallelism_config"):
        if kwargs.get(key) is None:
            kwargs.pop(key, None)
    if "fsdp_plugin" in kwargs:
        raise ConfigError(
            "accelerate's FSDP plugin would wrap the whole model over every process; mtk shards its TP model with "
            "FSDP2 from parallelism_config (dp_shard_size): pass that instead"
        )
    return Accelerator(**kwargs)


@contextlib.contextmanager
def _saving_on_signals(trainer: Any) -> Iterator[SaveAndStopOnSignal | None]:
    """For the block: signals save and stop the Trainer (:class:`SaveAndStopOnSignal`); then the signals' handlers
    are the caller's again. In another thread than the main one (where Python installs no handler): as before."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    exit_signal = ExitSignal(trainer.accelerator.device, resume_hint=RESUME_HINT)
    stop = SaveAndStopOnSignal(exit_signal)
    trainer.add_callback(stop)
    trainer._signal_stop = stop  # (its evaluations stop on a signal too: EvaluationStopsOnSignal)
    try:
        yield stop
    finally:
        trainer.remove_callback(stop)
        trainer._signal_stop = None
        if stop.stopped_at is None:  # (a stopped run ends now: a duplicate delivery of its signal stays a duplicate)
            exit_signal.restore()
    if exit_signal.received and stop.stopped_at is None:  # it came after the last step: the caller's handler has it
        signal.raise_signal(exit_signal.received)


RESUME_HINT = "resume_from_checkpoint=True continues from the newest checkpoint"


@contextlib.contextmanager
def _in_trainer_module(**names: Any) -> Iterator[None]:
    """transformers' trainer module sees ``names`` (its ``Accelerator``, ``skip_first_batches``, ``sort_checkpoints``)
    while the block runs: the Trainer builds and calls them by those module-level names (no hook passes others)."""
    saved = {name: getattr(hf_trainer, name) for name in names}
    for name, value in names.items():
        setattr(hf_trainer, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(hf_trainer, name, value)


def _loaded_by_mtk(*args: Any, **kwargs: Any) -> None:
    """transformers' ``deepspeed_load_checkpoint`` under mtk: DeepSpeed's state is in mtk's checkpoint
    (``checkpoint-N/deepspeed/``), which ``_load_optimizer_and_scheduler`` loads with the rest (one line for a
    checkpoint another engine wrote); transformers looked for ``global_step*`` folders beside it and raised."""


# what evaluation returns when a pipeline runs the model: its loss, which the last stage computes and broadcasts
_PIPELINE_LOSS_ONLY = (
    "with pp > 1 the pipelined model returns its loss only, not logits, which compute_metrics and predict() need: "
    "evaluate without compute_metrics (evaluate() gives eval_loss), or at pp = 1"
)


def _refuse_a_checkpoint_past_max_steps(checkpoint: str | None, max_steps: int) -> None:
    """transformers' loop checks ``max_steps`` only after a step: a resume from ``checkpoint-4`` with ``max_steps``
    3 trained a fifth step, wrote ``checkpoint-5``, and the script's ``save_model`` replaced the final model with it,
    exit 0. A Trainer that trained nothing would then save the checkpoint's weights as the final model of a shorter
    run, so it is one line. A checkpoint at ``max_steps`` itself (a requeued job that had finished) trains nothing
    and exits as the finished run did (``TrainerCheckpointing._init_training_state``)."""
    if checkpoint is None or max_steps <= 0:
        return
    try:
        step = json.loads((Path(checkpoint) / hf_trainer.TRAINER_STATE_NAME).read_text()).get("global_step")
    except (OSError, ValueError, AttributeError):  # (its checks, where the resume reads it, say what is wrong)
        return
    if isinstance(step, int) and step > max_steps:
        raise ConfigError(
            f"{checkpoint} is at step {step}, past max_steps {max_steps}: nothing is left to train (transformers' "
            "loop would train one step more and save that); give a larger max_steps to continue"
        )


def _refuse_for_the_layout(args: Any, parallel: Any) -> None:
    """What the arguments ask that this layout cannot do, in one line before anything is built.

    ``label_smoothing_factor`` with pp > 1: the pipeline backpropagates its own loss inside its forward.
    ``auto_find_batch_size`` halves a process's batch where that process ran out of memory; the ranks of one
    replica (TP, PP, CP, the EP exchange) compute one batch together, and one of them retrying alone would leave the
    others waiting in a collective."""
    if getattr(args, "label_smoothing_factor", 0.0) and parallel.pp_size > 1:
        raise ConfigError(
            f"TrainingArguments.label_smoothing_factor={args.label_smoothing_factor} with pp > 1: the pipeline "
            "computes and backpropagates the model's own loss inside its forward; set it to 0, or use pp = 1 (TP, "
            "CP and DP smooth over the whole logits)"
        )
    sizes = {"tp": parallel.tp_size, "pp": parallel.pp_size, "cp": parallel.cp_size, "ep": parallel.ep_size}
    if getattr(args, "auto_find_batch_size", False) and max(sizes.values()) > 1:
        layout = ", ".join(f"{name} {size}" for name, size in sizes.items() if size > 1)
        raise ConfigError(
            f"TrainingArguments.auto_find_batch_size=True at {layout}: it halves the batch of the process that ran "
            "out of memory, and the ranks that compute one batch together would wait for it in a collective; set "
            "per_device_train_batch_size yourself (mtk plan estimates the memory), or turn it off"
        )


_UNSET = object()  # (an attribute not looked up yet)


class ParallelTrainerMixin(TrainerHub, TrainerCheckpointing, EvaluationStopsOnSignal):
    """Put before transformers' or TRL's trainer class: ``class Trainer(ParallelTrainerMixin, transformers.Trainer)``.

    See the module docstring for what it changes and why.
    """

    accelerator: Accelerator
    args: Any
    model: Any
    state: Any
    control: Any
    callback_handler: Any
    compute_metrics: Any
    processing_class: Any
    lr_scheduler: Any
    hp_search_backend: Any
    eval_dataset: Any
    _counting_tokens: bool = False
    _deepspeed_for_inference: bool = False  # an evaluation before train() set DeepSpeed up for inference
    _peft_config: Any = None  # a LoraConfig taken from peft_config= by the TRL trainers
    _peft_model: Any = None  # the PeftModel of mtk's adapters on the converted model
    _path_loader: PathLoader | None = None  # TRL's model loading by path, for mtk's TRL trainers
    _position_limit: Any = _UNSET  # the model's learned positions (None: no table), once looked up

    # ------------------------------------------------------------------------------ accelerator and model
    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's, with mtk's Accelerator. A setting the libraries refuse while the processes are joined (a
        DeepSpeed JSON in a script started without a launcher) is one line (:func:`mtk.errors.library_refusals`),
        as in the example scripts: a user's own script does not build its trainer inside that block."""
        with library_refusals(), process_group_start():  # (TrainingArguments' devices form the process group)
            self._create_accelerator()
        if self.model is not None:  # (mtk's own work: an error there is a bug, with its traceback)
            self._parallelize(self.model)

    def _create_accelerator(self) -> None:
        check_training_arguments(self.args)
        if default_device().type == "cpu" and not self.args.use_cpu and not self.args.deepspeed:
            # Without use_cpu, TrainingArguments' device set-up on a machine without an accelerator sees one
            # process and resets accelerate's shared state to it; mtk.Accelerator joins the processes with gloo.
            self.args.use_cpu = True
            self.args.__dict__.pop("_setup_devices", None)  # (a cached_property: set up again, with use_cpu)
            if int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) == 0:
                print("mtk: no accelerator on this machine: TrainingArguments.use_cpu set to True (gloo)")
        idle: list[str] = []
        if self.args.deepspeed:
            idle = check_deepspeed_json(self.args)
            derive_global_batch(self.args)
            if default_device().type == "cpu":
                deepspeed_processes_on_cpu(self.args)
        elif self.args.deepspeed_plugin is not None:  # accelerate's YAML names the JSON
            fill_launchers_deepspeed_config(self.args)
            derive_global_batch(self.args)
        refuse_deepspeed_disagreements(self.args)
        if self.args.deepspeed or self.args.deepspeed_plugin is not None:
            refuse_replaced_choices(self.args)
        _ = self.args.device  # set up before the Accelerator: TrainingArguments resets accelerate's state there
        with _in_trainer_module(Accelerator=_mtk_accelerator):
            super().create_accelerator_and_postprocess()  # type: ignore[misc]
        _refuse_for_the_layout(self.args, self.accelerator.parallel)
        self.accelerator.settings, recompute = recompute_settings(self.args, self.accelerator.settings)
        replaced = (recompute, clipping_report(self.args, self.accelerator.settings), jit_checkpoint_report(self.args))
        for line in (*idle, *replaced):
            if line:
                self.accelerator.print(line)

    def _parallelize(self, model: Any) -> Any:
        """``model`` converted in place; with a ``peft_config`` (mtk's TRL trainers), the ``PeftModel`` of mtk's
        adapters on it (:mod:`mtk.trainers.adapters`)."""
        refuse_peft_model(model, type(self).__name__)
        unread = self._path_loader.take_unread(model) if self._path_loader is not None else None
        self.accelerator.parallelize(model, checkpoint=unread)  # a model given by path: this rank's slices read
        if self._peft_config is None:
            return model
        self._peft_model = add_adapters(self.accelerator, model, self._peft_config, self.args)
        return self._peft_model

    def _validate_args(self) -> None:
        """The Trainer's. ``Trainer.__init__`` calls it right after setting ``model`` from its argument: with
        adapters, the ``PeftModel`` is the trainer's model from here on (TRL's code after ``__init__`` sees it)."""
        if self._peft_model is not None:
            self.model = self.model_wrapped = self._peft_model
        super()._validate_args()  # type: ignore[misc]

    def call_model_init(self, trial: Any = None) -> Any:
        model = super().call_model_init(trial)  # type: ignore[misc]
        if getattr(self, "accelerator", None) is not None:
            model = self._parallelize(model)
        return model

    # ----------------------------------------------------------------------------------------- sizes
    def get_tp_size(self) -> int:
        """Ranks that share one batch: the replica's TP x PP ranks and its CP ranks, which split the batch's
        sequences (1 while counting tokens, see below)."""
        if self._counting_tokens:
            return 1
        parallel = self.accelerator.parallel
        return parallel.tp_size * parallel.pp_size * parallel.cp_size

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        """The Trainer's count of label tokens over the step, summed over the data-parallel replicas. It divides
        by the TP size because accelerate's gather repeats a replica's count on each of its ranks; mtk's gather
        spans the replicas only, so that division is not made (and no float division is undone)."""
        self._counting_tokens = True
        try:
            return super()._get_num_items_in_batch(batch_samples, device)  # type: ignore[misc]
        finally:
            self._counting_tokens = False

    # ---------------------------------------------------------------------------------------- training
    def _check_positions(self, inputs: dict[str, Any]) -> None:
        """A batch past the model's learned positions is one line (:mod:`mtk.trainers.positions`)."""
        if self._position_limit is _UNSET:  # (collective, once: a pipeline's first stage alone holds the table)
            model = self.accelerator.unwrap_model(self.model)
            stage = model.module if isinstance(model, PipelineModel) else model  # (this rank's stage of the model)
            self._position_limit = learned_positions(hf_model(stage))
        check_batch_positions(inputs, self._position_limit, self.args, self.accelerator.device)

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        self._check_positions(inputs)
        if isinstance(model, PipelineModel):
            self.accelerator.pipeline_loss_factor = self._pipeline_loss_factor(num_items_in_batch)
        return super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]

    def _pipeline_loss_factor(self, num_items_in_batch: Any) -> float:
        """What ``Trainer.compute_loss`` and ``training_step`` multiply the model's loss by before backward."""
        trainer: Any = self
        if trainer.compute_loss_func is not None or trainer.label_smoother is not None:
            raise ConfigError(
                "Trainer(compute_loss_func=...) or label smoothing with pp > 1: the pipeline computes and "
                "backpropagates the model's own loss inside its forward; leave them unset, or use pp = 1"
            )
        factor = 1.0
        token_weighted = trainer.model_accepts_loss_kwargs and num_items_in_batch is not None
        if self.args.average_tokens_across_devices and token_weighted:
            factor *= self.accelerator.num_processes // self.get_tp_size()
        scaled_for_accumulation = trainer.loss_is_scaled_for_ga
        if scaled_for_accumulation is None:
            scaled_for_accumulation = token_weighted
        if not scaled_for_accumulation:
            factor /= trainer.current_gradient_accumulation_steps
        return factor

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        """The pipeline-running model for evaluation too (the Trainer evaluates ``self.model``, this rank's stage,
        when it finds it unwrapped)."""
        wrapped = getattr(self, "model_wrapped", None)
        if isinstance(wrapped, PipelineModel) and model is self.model:
            return wrapped
        return super()._wrap_model(model, training, dataloader)  # type: ignore[misc]

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's, with its step rate counted over the data-parallel replicas (:meth:`_replica_speed`)."""
        with _in_trainer_module(speed_metrics=self._replica_speed):
            return super().evaluate(*args, **kwargs)  # type: ignore[misc]

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """As :meth:`evaluate`."""
        with _in_trainer_module(speed_metrics=self._replica_speed):
            return super().predict(*args, **kwargs)  # type: ignore[misc]

    def _replica_speed(
        self, split: str, start_time: float, num_samples: int | None = None, num_steps: Any = None, **kwargs: Any
    ) -> dict[str, float]:
        """transformers' ``speed_metrics`` for an evaluation: its step count divides the rows by the eval batch
        times the world size, and the world counts every TP, PP and CP rank of a replica, which share one batch;
        the replicas are ``world / get_tp_size()``."""
        if num_samples is not None and num_steps is not None:
            replicas = max(1, self.accelerator.num_processes // self.get_tp_size())
            num_steps = math.ceil(num_samples / (self.args.eval_batch_size * replicas))
        return _speed_metrics(split, start_time, num_samples=num_samples, num_steps=num_steps, **kwargs)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's; an evaluation before any training sets DeepSpeed up through mtk's
        :func:`deepspeed_init_in_one_line` too, for inference (see :meth:`train`)."""
        with _in_trainer_module(deepspeed_init=deepspeed_init_in_one_line):
            return super().evaluation_loop(*args, **kwargs)  # type: ignore[misc]

    def prediction_step(
        self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> Any:
        """The Trainer's, with the full logits when the evaluation asks for them (``compute_metrics``): a
        forward with labels otherwise returns none under TP (:mod:`mtk.rules.lm_head`)."""
        self._check_positions(inputs)
        if prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)  # type: ignore[misc]
        if isinstance(model, PipelineModel):
            raise ConfigError(_PIPELINE_LOSS_ONLY)
        with logits_mode(self.model, "full"):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)  # type: ignore[misc]

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's, skipping resumed batches through ``mtk.Accelerator`` (whose loaders broadcast each
        batch from the replica's source rank); checkpoints carry the tokenizer, so ``mtk export`` ships it.

        The output directory is this run's alone (:func:`claim_output_dir`), and a signal saves and stops: SIGTERM
        (a scheduler's preemption), SIGINT or SIGHUP save ``checkpoint-N`` at the next step's end on every rank,
        say so in one line, and end the process (status 0, as mtk's scripts): code after ``train()`` would treat
        the stopped run as finished. A second signal stops at once (:class:`~mtk.training.signals.ExitSignal`)."""
        trial = kwargs.get("trial", args[0] if args else None)
        # a search's trial sets DeepSpeed up again (transformers' _hp_search_setup, which asks for both)
        searching = getattr(self, "hp_search_backend", None) is not None and trial is not None
        if getattr(self, "deepspeed", None) is not None and not self._deepspeed_for_inference and not searching:
            raise ConfigError(
                "train() a second time under DeepSpeed: its engine, optimizer and scheduler are set up once per "
                "Trainer (a second set-up failed in accelerate's register_for_checkpointing): build another Trainer "
                f"to go on ({RESUME_HINT})"
            )
        if self._deepspeed_for_inference:
            raise ConfigError(
                "train() after evaluate() or predict() under DeepSpeed: transformers set DeepSpeed up for inference "
                "(the JSON's optimizer removed, its step counts filled for none); call train() first (eval_on_start "
                "evaluates before the first step), or build another Trainer to train"
            )
        if self.args.eval_on_start and self.eval_dataset is None:  # (transformers raises it after set-up, as a bug)
            raise ConfigError("eval_on_start needs an eval_dataset: give one (--eval_data) or leave eval_on_start off")
        evaluates = str(getattr(self.args.eval_strategy, "value", self.args.eval_strategy)) != "no"
        logits = evaluates and not self.args.prediction_loss_only  # (loss only: transformers never asks for logits)
        if self.compute_metrics is not None and self.accelerator.parallel.pp_size > 1 and logits:
            raise ConfigError(_PIPELINE_LOSS_ONLY)  # (here, not at the first evaluation, after steps were trained)
        resume_from_checkpoint = claim_output_dir(
            self.args.output_dir, resume_from_checkpoint, main_process=self.accelerator.is_main_process
        )
        _refuse_a_checkpoint_past_max_steps(resume_from_checkpoint, self.args.max_steps)
        self.accelerator.checkpoint_tokenizer = self._saveable_tokenizer()
        self._record_data_stream(resume_from_checkpoint)  # (a resume on other rows is one line)
        skipping, sorting = self.accelerator.skip_first_batches, written_checkpoints
        with (
            _saving_on_signals(self) as stop,
            _in_trainer_module(
                skip_first_batches=skipping,
                sort_checkpoints=sorting,
                deepspeed_load_checkpoint=_loaded_by_mtk,
                deepspeed_init=deepspeed_init_in_one_line,
            ),
        ):
            result = super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        if stop is not None and stop.stopped_at is not None:
            name, folder = stop.signal_name, Path(self.args.output_dir) / f"checkpoint-{stop.stopped_at}"
            said = f"saved {folder}" if folder.is_dir() else "stopped (no checkpoint was written)"
            self.accelerator.print(f"mtk: {name}: {said}; continue with resume_from_checkpoint=True")
            raise SystemExit(0)
        return result

    # ------------------------------------------------------------------------------------- checkpoints
    def create_optimizer(self, model: Any = None) -> Any:
        """The Trainer's. Settings it cannot build an optimizer from (``optim`` whose package is not installed,
        a beta torch refuses) are one line (:func:`mtk.errors.library_refusals`): ``train`` builds it, after the
        script's own set-up, so nothing else turns them into one."""
        with library_refusals():
            return super().create_optimizer(model)  # type: ignore[misc]

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        with library_refusals():  # (as the optimizer's)
            scheduler = super().create_scheduler(num_training_steps, optimizer)  # type: ignore[misc]
        custom = self.accelerator._custom_objects
        custom[:] = [obj for obj in custom if not isinstance(obj, torch.optim.lr_scheduler.LRScheduler)]
        self.accelerator.register_for_checkpointing(scheduler)  # saved and restored inside mtk's checkpoint
        return scheduler
