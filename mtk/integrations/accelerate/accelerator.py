"""``mtk.Accelerator``: accelerate's Accelerator, made aware of tensor and pipeline parallelism.

A plain accelerate script changes only its import: ``prepare`` converts an HF model by the rules (and
with pp > 1 cuts it to this rank's stage, returning a :class:`~mtk.pipeline.engine.PipelineModel` whose
forward runs the micro-batch schedule, as accelerate's Megatron-LM integration does), and everything
that depends on which processes hold what follows the Megatron layout instead of treating every
process as a replica: data and DDP over DP, clipping by the true global norm, metrics over DP
(:mod:`~mtk.integrations.accelerate.collectives`), sharded atomic checkpoints
(:mod:`~mtk.integrations.accelerate.checkpoint`). docs/training.md lists every accelerate API and what
mtk does with it; docs/architecture.md where the TP/PP sizes come from. Accelerate's own Megatron
plugin (NVIDIA's Megatron-LM package) is not used.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from accelerate import Accelerator as _AccelerateAccelerator
from accelerate.utils import PrecisionType, parse_flag_from_env
from torch import nn

from mtk.config import ParallelConfig, RunSettings
from mtk.errors import ConfigError, library_refusals, process_group_start
from mtk.integrations.accelerate.checkpoint import ShardedCheckpointing
from mtk.integrations.accelerate.collectives import DataParallelCollectives
from mtk.integrations.accelerate.convert import ReplacedParams, repoint
from mtk.integrations.accelerate.data_path import DataPath
from mtk.integrations.accelerate.deepspeed import (
    check_launcher_sections,
    deepspeed_initialize_with_mpu,
    reconcile_accelerate_batch,
    reconcile_gradient_clipping,
    refuse_two_optimizers,
    replace_accelerated_schedulers,
    scheduler_steps_over_replicas,
    user_batch_fields,
)
from mtk.integrations.accelerate.init import (
    accumulation_from_launcher,
    apply_timeout,
    check_expert_parallel,
    gloo_for_deepspeed,
    megatron_plugin_off,
    resolve_topology,
)
from mtk.integrations.accelerate.megatron_keys import check_engine, check_megatron_environment
from mtk.integrations.accelerate.model_conversion import ModelConversion
from mtk.integrations.accelerate.parameter_sharding import ParameterSharding
from mtk.integrations.accelerate.scheduler import DataParallelScheduler
from mtk.integrations.accelerate.sharding import accelerate_fsdp_off, sharding_from_accelerate
from mtk.integrations.deepspeed import held_elements as deepspeed_held_elements
from mtk.integrations.deepspeed import remove_shm_buffers_at_exit, zero3_whole
from mtk.integrations.deepspeed_experts import check_deepspeed_experts, follow_param_group_split
from mtk.parallel.amp import TPGradScaler
from mtk.parallel.consistency import check_same_loss, same_inputs_hook
from mtk.parallel.distributed_optimizer import shard_optimizer
from mtk.parallel.expert_parallel import is_expert_parallel, reduce_expert_gradients
from mtk.parallel.fsdp import held_elements, reshard
from mtk.parallel.gather import gather_state_dict
from mtk.parallel.grad_norm import clip_grad_norm_tp_
from mtk.parallel.grads import sum_tp_shared_grads_at_step, sync_sequence_parallel_grads
from mtk.parallel.optimizer_updates import check_elementwise_update, checked_additions
from mtk.parallel.parameters import is_tensor_parallel
from mtk.parallel.state import ParallelState, default_device
from mtk.pipeline.engine import PipelineModel
from mtk.training.entry import report_mtk_errors

__all__ = ["Accelerator", "DataParallelScheduler"]


class Accelerator(
    ModelConversion, DataPath, DataParallelCollectives, ShardedCheckpointing, ParameterSharding, _AccelerateAccelerator
):
    """accelerate's Accelerator with Megatron TP/DP (see the module docstring for what changes).

    Args:
        parallel_config: TP/PP sizes; default: the DeepSpeed JSON's ``"mtk"`` block (DeepSpeed) or the
            ``MEGATRON_LM_*`` variables. Explicit values win; an override is reported in one line.
        run_settings: micro-batches, pipeline schedule and layer split, SP, clipping; default: the
            launcher's variables (:class:`~mtk.config.RunSettings`).
        *args, **kwargs: as ``accelerate.Accelerator``, with accelerate's defaults. ``cpu`` defaults to
            True on machines without an accelerator, which is what makes accelerate join the processes
            with gloo. ``gradient_accumulation_steps=None`` is not given: accelerate's 1, or under DeepSpeed
            what the JSON's batch fields give; under DeepSpeed, after ``prepare``, the attribute is the
            accumulation the engine steps with (``reconcile_batch``; a given value that overrides the
            JSON's is reported in one line).
    """

    scaler: Any  # accelerate's GradScaler (mtk's TP-aware one under fp16), or None

    def __init__(
        self,
        *args,
        parallel_config: ParallelConfig | None = None,
        run_settings: RunSettings | None = None,
        **kwargs,
    ) -> None:
        # a user's own loop: an mtk error that reaches the top is one line over the ranks, as in mtk's scripts
        report_mtk_errors(os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "mtk")
        reports: list[str] = []  # said once accelerate's state exists (on the main process)
        # accelerate's ND layout: its tp_size is mtk's TP, its dp_shard/dp_replicate sizes FSDP2 over mtk's DP
        parallel_config, self.sharding = sharding_from_accelerate(
            kwargs.pop("parallelism_config", None), parallel_config, reports.append
        )
        self.settings = run_settings or RunSettings.from_env()
        # None: not given (accelerate's 1, or under DeepSpeed what the JSON's batch fields give)
        if kwargs.get("gradient_accumulation_steps") is None:
            kwargs.pop("gradient_accumulation_steps", None)
        self._explicit_accumulation: int | None = kwargs.get("gradient_accumulation_steps")
        on_cpu = default_device().type == "cpu"
        given = kwargs.get("mixed_precision")
        if isinstance(given, str) and given.lower() in [p.value for p in PrecisionType]:
            kwargs["mixed_precision"] = given.lower()  # (TrainingArguments passes the variable's "BF16" on as given)
        precision = os.environ.get("ACCELERATE_MIXED_PRECISION")  # accelerate takes any value there as "no"
        if kwargs.get("mixed_precision") is None and precision is not None:
            allowed = [p.value for p in PrecisionType]
            if precision.lower() not in allowed:
                raise ConfigError(
                    f"ACCELERATE_MIXED_PRECISION={precision} is none of {', '.join(allowed)} (accelerate would train "
                    "in fp32 without a word); set one of them, or unset it"
                )
            if precision != precision.lower():  # accelerate lower-cases the argument, not the variable ("BF16": fp32)
                os.environ["ACCELERATE_MIXED_PRECISION"] = precision.lower()
                reports.append(f"mtk: ACCELERATE_MIXED_PRECISION={precision} read as {precision.lower()}")
        self.uses_deepspeed = (
            os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
            or kwargs.get("deepspeed_plugin") is not None
            or kwargs.get("deepspeed_plugins") is not None
        )
        if kwargs.get("fsdp_plugin") is not None:
            raise ConfigError(
                "accelerate's fsdp_plugin would wrap the whole model over every process; mtk shards its TP model "
                "with FSDP2 from parallelism_config (dp_shard_size): pass that instead"
            )
        if self.uses_deepspeed and self.sharding is not None:
            raise ConfigError(
                "parallelism_config dp_shard_size > 1 (FSDP2) next to DeepSpeed: both would shard over data "
                "parallelism; use DeepSpeed's ZeRO stage or drop the DeepSpeed config"
            )
        if self.uses_deepspeed:
            reports += check_launcher_sections()  # before accelerate's plugin reads the JSON
            remove_shm_buffers_at_exit()
        if self.uses_deepspeed and parse_flag_from_env("ACCELERATE_USE_CPU"):  # accelerate would drop DeepSpeed
            if not on_cpu:
                raise ConfigError(
                    "ACCELERATE_USE_CPU=true next to a DeepSpeed config: accelerate would drop DeepSpeed and train "
                    f"without it on the CPU; unset ACCELERATE_USE_CPU to train under DeepSpeed on {default_device()}, "
                    "or drop the DeepSpeed config"
                )
            os.environ["ACCELERATE_USE_CPU"] = "false"
            reports.append(
                "mtk: ACCELERATE_USE_CPU=true set aside: this machine has no accelerator, so DeepSpeed runs on the "
                "CPU anyway (accelerate would have dropped DeepSpeed)"
            )
        if self.uses_deepspeed and on_cpu:
            # accelerate forms DeepSpeed's process group only when not told cpu=True (which drops the
            # DeepSpeed plugin) and, without a GPU, only with an explicit backend: gloo.
            if kwargs.get("cpu"):
                raise ConfigError("DeepSpeed through accelerate cannot run with cpu=True; leave cpu unset")
            kwargs["cpu"] = False
            kwargs["kwargs_handlers"] = gloo_for_deepspeed(kwargs.get("kwargs_handlers") or [])
        kwargs.setdefault("cpu", on_cpu)
        with (
            megatron_plugin_off(),
            accelerate_fsdp_off(),
            accumulation_from_launcher(self._explicit_accumulation, reports.append),
            library_refusals(),  # accelerate's refusals of the environment (a launcher's variables set by hand)
            process_group_start(),  # (accelerate forms the process group here)
        ):
            super().__init__(*args, **kwargs)
        for line in reports:
            self.print(line)
        apply_timeout(kwargs.get("kwargs_handlers") or [])
        if self.mixed_precision == "fp16" and self.scaler is None and not self.uses_deepspeed:
            # accelerate accepts fp16 on CPU but runs it as fp32 (no autocast, no loss scaling): say so.
            self.print(
                f"mtk: mixed_precision=fp16 on {self.device.type}: accelerate runs no fp16 autocast or loss scaling "
                "there, so training is fp32"
            )
        check_megatron_environment(os.environ, self.print)
        check_engine(self.settings, deepspeed=self.uses_deepspeed)
        ds_config = self.state.deepspeed_plugin.deepspeed_config if self.uses_deepspeed else None
        if self.uses_deepspeed:  # as the user's JSON states them (accelerate's plugin has filled in some)
            passed_in = any(kwargs.get(key) is not None for key in ("deepspeed_plugin", "deepspeed_plugins"))
            self.deepspeed_batch_fields = user_batch_fields(self.state.deepspeed_plugin, from_launcher=not passed_in)
            if run_settings is not None:  # a script's own clipping (--max_grad_norm) reaches DeepSpeed's step
                self.settings = reconcile_gradient_clipping(
                    self.state.deepspeed_plugin.deepspeed_config, self.settings, self.deepspeed_batch_fields[1]
                )
        config = resolve_topology(parallel_config, ds_config)
        self.parallel = ParallelState.build(
            config.tp_size,
            config.pp_size,
            cp_size=config.cp_size,
            ep_size=config.ep_size,
            etp_size=config.etp_size,
            device=self.device,
        )
        unused = self.settings.check_pipeline(self.parallel.pp_size) + self.settings.check_context(config.cp_size)
        for line in unused:
            self.print(line)
        self._check_sharding()
        check_expert_parallel(config, sharding=self.sharding)
        if self.uses_deepspeed:  # before a model is built (ZeRO-3 would build it partitioned)
            check_deepspeed_experts(
                self.state.deepspeed_plugin.deepspeed_config, self.parallel, self.deepspeed_batch_fields[1]
            )
        self._data_parallel_mesh: Any = None  # FSDP2's, built with the first prepared model
        self._replaced_params: ReplacedParams = {}  # id(unconverted param) -> (weakref to it, its shard)
        # The data position, across epochs (accelerate's ``step`` restarts at every epoch end).
        self.micro_batches_seen = 0  # micro-batches each replica has consumed
        self.completed_steps = 0  # optimizer steps
        self.checkpoint_tokenizer = None  # saved into <checkpoint>/tokenizer, so `mtk export` ships it
        self._clipping_reported = False  # (under DeepSpeed: a clip_grad_norm_ max_norm the engine does not use)
        # What identifies the rows the data position counts through (a trainer's: its data's digest, the order's
        # seed), recorded in each checkpoint's data position; None: nothing recorded.
        self.data_stream: dict[str, Any] | None = None
        # What a pipelined model backpropagates per batch, times its loss: None is accelerate's 1 / accumulation
        # steps; a trainer that scales the loss itself (transformers' Trainer: token counts, DP size) sets it.
        self.pipeline_loss_factor: float | None = None
        if self.scaler is not None:  # fp16: every model-parallel rank must agree on skipping a step
            self.scaler = TPGradScaler.from_scaler(self.scaler, self.parallel)

    # ------------------------------------------------------------------------- layout, as accelerate names it
    @property
    def tensor_parallel_rank(self) -> int:
        """This process's rank in its tensor-parallel group."""
        return self.parallel.tp_rank

    @property
    def pipeline_parallel_rank(self) -> int:
        """This process's pipeline stage."""
        return self.parallel.pp_rank

    @property
    def context_parallel_rank(self) -> int:
        """This process's rank in its context-parallel group (which part of every sequence it holds)."""
        return self.parallel.cp_rank

    @property
    def data_parallel_rank(self) -> int:
        """This process's model replica (its data shard): what accelerate calls the dp_replicate rank."""
        return self.parallel.dp_rank

    # ------------------------------------------------------------------------------------ prepare
    def prepare(self, *args, device_placement=None):
        """As accelerate's, after converting HF models: optimizers built on the unconverted model's
        parameters (the usual order in accelerate scripts) are re-pointed at the shards, and with
        pp > 1 hold only this stage's parameters (accelerate's DeepSpeed path hands optimizers to
        ``deepspeed.initialize`` without :meth:`prepare_optimizer`, so it is done here too)."""
        args = [self._convert_once(obj) if isinstance(obj, nn.Module) else obj for obj in args]
        for obj in args:
            if isinstance(obj, torch.optim.Optimizer):
                repoint(obj, self._replaced_params)
                self._check_update(obj, [m for m in args if isinstance(m, nn.Module)])
        if not self.uses_deepspeed:
            return super().prepare(*args, device_placement=device_placement)
        refuse_two_optimizers(self, tuple(args))
        reconcile_accelerate_batch(self, tuple(args), self._explicit_accumulation)
        with (
            deepspeed_initialize_with_mpu(self.parallel, self.deepspeed_batch_fields[1]),
            scheduler_steps_over_replicas(self, tuple(args)),
        ):
            prepared = super().prepare(*args, device_placement=device_placement)
        return replace_accelerated_schedulers(self, prepared)

    def _convert_once(self, model: nn.Module) -> nn.Module:
        """:meth:`_convert`, remembering which parameters the conversion replaced (for optimizers)."""
        model, replaced = self._convert(model)
        self._replaced_params.update(replaced)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):
        """accelerate's, once the optimizer points at the converted model's parameters (an optimizer
        built before ``prepare`` holds the unconverted ones; another stage's parameters are dropped)."""
        if not getattr(optimizer, "_is_accelerate_prepared", False):
            repoint(optimizer, self._replaced_params)
            self._check_update(optimizer, [])
            self._check_one_optimizer_for_experts(optimizer)
            if self.settings.use_distributed_optimizer and not self.uses_deepspeed:
                # ZeRO-1 over DP x CP, the experts over their replicas; re-synced after step
                shard_optimizer(optimizer, self.parallel.replica_group, self.parallel.expert_replica_group)
        return super().prepare_optimizer(optimizer, device_placement)

    def _check_update(self, optimizer: torch.optim.Optimizer, models: list[nn.Module]) -> None:
        """An optimizer holding TP-split (or FSDP2-sharded) parameters must update each element on its own (once per
        optimizer: ``prepare`` and accelerate's ``prepare_optimizer`` both see it)."""
        if (self.parallel.tp_size == 1 and self.sharding is None) or getattr(optimizer, "_mtk_update_checked", False):
            return
        sharded = [
            p
            for model in [*models, *self._models]
            for p in model.parameters()
            if is_tensor_parallel(p) or self.sharding is not None
        ]
        stands_for = None  # accelerate's DummyOptim stands for the DeepSpeed JSON's optimizer
        if self.uses_deepspeed and type(optimizer).__name__ == "DummyOptim":
            block = self.state.deepspeed_plugin.deepspeed_config.get("optimizer") or {}
            stands_for = str(block.get("type", "AdamW")) if isinstance(block, dict) else None
        check_elementwise_update(optimizer, sharded, self.print, stands_for)
        optimizer._mtk_update_checked = True  # type: ignore[attr-defined]  # a mark on the user's object
        if stands_for is None:  # (a DummyOptim is no optimizer to add to)
            additions = checked_additions(optimizer, sharded, self.print)
            optimizer.add_param_group = additions  # type: ignore[method-assign,assignment]

    def _check_one_optimizer_for_experts(self, optimizer: torch.optim.Optimizer) -> None:
        """A checkpoint of experts spread over EP is written in pieces, which are read back for one optimizer: a
        second one is one line when it is prepared, not when the first save comes."""
        if self.parallel.ep_size == 1 or not self._optimizers:
            return
        held = [p for o in (*self._optimizers, optimizer) for group in o.param_groups for p in group["params"]]
        if any(is_expert_parallel(p) for p in held):
            raise ConfigError(
                f"expert parallelism (ep = {self.parallel.ep_size}) with {len(self._optimizers) + 1} optimizers: its "
                "checkpoints hold one optimizer's state; use one optimizer (parameter groups for different settings)"
            )

    # ---------------------------------------------------------------------- DeepSpeed (ZeRO over DP)
    @property
    def _deepspeed_engine(self):
        return self.deepspeed_engine_wrapped.engine if self.deepspeed_engine_wrapped is not None else None

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        if getattr(model, "_is_accelerate_prepared", False):
            return super().prepare_model(model, device_placement, evaluation_mode)
        model = self._convert_once(model)
        if not self.uses_deepspeed:  # backward() finishes the gradients once per step: the TP sums move there
            sum_tp_shared_grads_at_step(model, self.parallel.tp_group)
        # accelerate's own preparation (mixed-precision forward, device placement), but not its DDP,
        # which would span every process: replicas are only the data-parallel group.
        model = super().prepare_model(model, device_placement, evaluation_mode=True)
        if self.parallel.dp_size != self.num_processes:  # per-rank inputs would be mixed silently: one line
            model.register_forward_pre_hook(  # (prepended: before CP's split of the rows)
                same_inputs_hook(self.parallel.batch_group, self.parallel.device), with_kwargs=True, prepend=True
            )
        if isinstance(model, PipelineModel):  # the schedule backpropagates; gradients sync in backward()
            if self.sharding is not None:  # each stage's layers sharded over its DP group
                self._shard(model)
                model.sharded_over_data_parallel = True
            model.scale_loss = self._scale_pipeline_loss
            model.syncs_this_call = lambda: self.sync_gradients  # its last backward starts the DP reduction
            return model
        if self.sharding is not None:  # FSDP2 over DP: each decoder layer a unit; gradients reduce-scattered
            self._shard(model)
            return model
        trains = not evaluation_mode and any(p.requires_grad for p in model.parameters())
        if trains and self.parallel.replica_size > 1:  # DP x CP: ranks with the same weights average gradients
            kwargs = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
            device_ids = None if self.device.type == "cpu" else [self.device.index]
            experts = [name for name, param in model.named_parameters() if is_expert_parallel(param)]
            if experts:  # each EP rank's own experts: reduced over the expert replicas in backward()
                torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
            model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=device_ids, process_group=self.parallel.replica_group, **kwargs
            )
            self._models[-1] = model
        return model

    def _scale_pipeline_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """What ``backward`` would backpropagate: averaged over accumulation steps (or times the trainer's
        ``pipeline_loss_factor``), fp16-scaled."""
        factor = self.pipeline_loss_factor
        loss = loss / self.gradient_accumulation_steps if factor is None else loss * factor
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def prepare_scheduler(self, scheduler):
        if getattr(scheduler, "_is_accelerate_prepared", False):
            return super().prepare_scheduler(scheduler)
        follow_param_group_split(scheduler)  # under DeepSpeed with EP the experts took param groups of their own
        optimizer = next((o for o in self._optimizers if getattr(scheduler, "optimizer", None) is o.optimizer), None)
        prepared = DataParallelScheduler(
            scheduler,
            optimizer or self._optimizers,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
            dp_size=self.parallel.dp_size,
        )
        self._schedulers.append(prepared)
        return prepared

    # ----------------------------------------------------------------------------------- training
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()`` as accelerate does it; for a pipelined model the schedule already ran
        the backward passes, and only the gradient sync (tied embeddings, data parallel) is left. With
        tp x cp x pp > 1 the ranks computing on one batch must backpropagate the same loss (one line if not)."""
        check_same_loss(loss, self.parallel.batch_group, self.parallel.device)
        pipelines = [m for m in self._models if isinstance(m, PipelineModel)]
        if not pipelines:
            super().backward(loss, **kwargs)
        elif loss.requires_grad:
            raise ConfigError(
                "with pp > 1 the model's forward runs forward and backward; pass its detached outputs.loss "
                "to accelerator.backward (which finishes the gradient sync), not a loss computed outside the model"
            )
        if not self.sync_gradients:
            return
        for model in pipelines:
            model.finalize_grads()
        if self.parallel.ep_size > 1:
            for model in self._models:
                reduce_expert_gradients(
                    list(model.parameters()), self.parallel.expert_replica_group, self.parallel.replica_size
                )
        if self.parallel.tp_size > 1:  # SP's gradients, and those summed over TP once per step
            for model in self._models:
                sync_sequence_parallel_grads(model, self.parallel.tp_group)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm of the whole (unsplit) model's gradient; returns that norm."""
        if self.uses_deepspeed:  # DeepSpeed clipped (its "gradient_clipping", TP-aware through the mpu) in step
            engine = self._deepspeed_engine
            if engine is not None and not self._clipping_reported and float(engine.gradient_clipping()) != max_norm:
                self._clipping_reported = True  # (accelerate drops max_norm here without a word)
                self.print(
                    f"mtk: DeepSpeed clips gradients inside its step by its config's gradient_clipping "
                    f"{engine.gradient_clipping()}; clip_grad_norm_'s max_norm {max_norm} is not used (set "
                    '"gradient_clipping" in the DeepSpeed config instead)'
                )
            norm = engine.get_global_grad_norm() if engine is not None else None
            return torch.tensor(float(norm) if norm is not None else float("nan"))
        self.unscale_gradients()
        return clip_grad_norm_tp_(list(parameters), max_norm, self.parallel, norm_type)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """Full, unpadded tensors under HF names, on the main process (others get ``{}``).

        Gathered over TP (and from every pipeline stage) one tensor at a time, so no rank ever holds
        a second copy of its shard. Collective: every rank must call it.
        """
        model = self.unwrap_model(model) if unwrap else model
        reshard(model)  # FSDP2 units an evaluation left gathered
        if self.uses_deepspeed:  # ZeRO-3 partitions parameters over DP: each made whole in its turn
            return gather_state_dict(model, self.parallel, whole=zero3_whole)
        return gather_state_dict(model, self.parallel)

    def held_elements(self) -> dict[str, int]:
        """Model-state elements this rank holds, ``{"parameters", "optimizer_state"}``: what TP, FSDP2, the
        distributed optimizer or DeepSpeed's ZeRO left it of the prepared model and optimizers (sharding claims are
        checked against it; docs/memory.md)."""
        if self.uses_deepspeed and self._deepspeed_engine is not None:
            return deepspeed_held_elements(self._deepspeed_engine)
        optimizers = [getattr(o, "optimizer", o) for o in self._optimizers]
        counts = [
            held_elements(self.unwrap_model(model), optimizers if i == 0 else [])
            for i, model in enumerate(self._models)
        ]
        return {key: sum(c[key] for c in counts) for key in ("parameters", "optimizer_state")}

    def end_training(self) -> None:
        """accelerate's (trackers finished, process group destroyed), once every rank got here: a rank
        that tears its gloo connections down while a peer still reads its last message makes that peer
        abort at exit (seen under load with 8 processes on 2 cores)."""
        self.wait_for_everyone()
        super().end_training()

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """accelerate's unwrapping, then the pipeline wrapper: the (stage of the) HF model."""
        model = super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)
        return model.module if isinstance(model, PipelineModel) else model
