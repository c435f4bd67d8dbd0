"""How ``mtk.Accelerator`` converts a model: every rank first agrees on rank 0's weights and its replica's random
generators, then the HF model becomes tensor-parallel (and this rank's pipeline stage, wrapped in the schedule);
a model converted elsewhere (``load_pretrained_tp``) is checked against the run's layout."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn

from mtk.checkpoint.hf_load import load_slices
from mtk.config import RunSettings
from mtk.convert.regions import reseed_tp_stream
from mtk.errors import ConfigError
from mtk.integrations.accelerate.convert import ReplacedParams, convert_tracking
from mtk.integrations.accelerate.megatron_keys import act_on_model
from mtk.integrations.deepspeed import sums_over_context_parallel
from mtk.parallel.consistency import agree_rng, agree_weights
from mtk.parallel.context import attach_context_parallel, context_parallel_of
from mtk.parallel.record import hf_model, is_peft_model, parallelized
from mtk.parallel.state import ParallelState
from mtk.pipeline.engine import PipelineModel
from mtk.rules import replace_trl_fused_head

if TYPE_CHECKING:  # the mixin is checked as part of accelerate's Accelerator
    from accelerate import Accelerator as _Host
else:
    _Host = object

__all__ = ["ModelConversion"]

_AGREED = "_mtk_ranks_agreed"  # set on a model once its ranks agreed on weights and generators (as accelerate marks
# what it prepared), so prepare() and accelerate's prepare_model, which sees the model again, agree once


class ModelConversion(_Host):
    """The model conversion of ``mtk.Accelerator`` (a mixin in front of accelerate's ``Accelerator``)."""

    parallel: ParallelState
    settings: RunSettings
    uses_deepspeed: bool
    _replaced_params: ReplacedParams

    def _convert(self, model: nn.Module) -> tuple[nn.Module, ReplacedParams]:
        """Make ``model`` tensor-parallel (and cut to this rank's pipeline stage when pp > 1).

        Returns the model to train (a :class:`PipelineModel` when pp > 1) and a map from id(old
        parameter) to (a weak reference to it, its replacement by HF name, ``None`` when another
        stage owns it).
        """
        if isinstance(model, PipelineModel):
            return model, {}
        record = parallelized(model)
        sequence_parallel = self.settings.sequence_parallel and self.parallel.tp_size > 1
        if record is not None:  # converted already (load_pretrained_tp)
            if record.pp_size != self.parallel.pp_size or record.tp_size != self.parallel.tp_size:
                raise ConfigError(
                    f"the model was parallelized for tp={record.tp_size}, pp={record.pp_size}; this run "
                    f"is tp={self.parallel.tp_size}, pp={self.parallel.pp_size}: build it with this run's state"
                )
            if record.sequence_parallel != sequence_parallel:
                raise ConfigError(
                    f"the model was parallelized with sequence_parallel={record.sequence_parallel}, this run has "
                    f"megatron_lm_sequence_parallelism={sequence_parallel}: pass the run's setting to "
                    "load_pretrained_tp"
                )
            if not getattr(model, _AGREED, False):  # converted elsewhere (load_pretrained_tp), before the ranks agreed
                self._agree_rng()
                if record.rng is not None:
                    reseed_tp_stream(record.rng, self.parallel)
                setattr(model, _AGREED, True)
            act_on_model(model, self.settings, self.print)
            self._context_parallel(model)
            replace_trl_fused_head(model)  # trl's add_fused_lm_head after the conversion (TRL's trainers' __init__)
            return self._pipelined(model), {}
        _refuse_unconverted_peft_model(model, "prepare")
        if not getattr(model, _AGREED, False):  # prepare() converts, then accelerate's prepare_model comes here again
            self._agree(model)
            setattr(model, _AGREED, True)
        if not hasattr(model, "config"):
            if self.parallel.pp_size > 1:
                raise ConfigError("pipeline parallelism (pp > 1) needs an HF model with a config")
            return model, {}
        if any(hasattr(p, "ds_id") for p in model.parameters()):  # deepspeed.zero.Init's partitioned placeholders
            raise ConfigError(
                "the model was built under DeepSpeed's zero.Init (ZeRO-3 partitioned it at construction), which mtk "
                "cannot split over TP: build it with mtk.models.whole_parameters() or mtk.training.setup."
                "starting_model; deepspeed.initialize partitions it over the data-parallel group after the conversion"
            )
        replaced = convert_tracking(model, self.parallel, self.settings)
        act_on_model(model, self.settings, self.print)
        self._context_parallel(model)
        return self._pipelined(model), replaced

    def parallelize(self, model: nn.Module, checkpoint: str | Path | None = None) -> nn.Module:
        """The HF model made parallel for this run now instead of in ``prepare`` (in place; returns it), so
        that LoRA adapters can be added to its parallel layers (:func:`mtk.lora.get_peft_model`).

        With ``checkpoint``, ``model`` is :func:`mtk.checkpoint.hf_load.empty_model` of that HF directory (its
        parameters on the meta device): once converted, each parameter is read from there, this rank's slice only.
        """
        if parallelized(model) is not None:
            return model
        _refuse_unconverted_peft_model(model, "parallelize")
        if checkpoint is None:
            self._agree(model)
        else:
            self._agree_rng()  # every rank reads the same file: only the generators can differ
        setattr(model, _AGREED, True)
        replaced = convert_tracking(model, self.parallel, self.settings)
        if checkpoint is None:
            self._replaced_params.update(replaced)
        else:  # no optimizer can hold a parameter of a model that was never read
            load_slices(model, checkpoint, self.parallel)  # with EP, each rank's own experts only (spread)
        return model

    def _context_parallel(self, model: nn.Module) -> None:
        """With cp > 1: the model splits each batch over the CP group and attends across it
        (:func:`~mtk.parallel.context.attach_context_parallel`); a backend megatron_lm_attention_backend chose is
        replaced, and said so."""
        if self.parallel.cp_size == 1 or context_parallel_of(model) is not None:
            return
        chosen = getattr(model.config, "_attn_implementation", None)
        sequence_split = self.parallel.tp_size if self.settings.sequence_parallel else 1
        # ZeRO 0-2 sum the CP ranks' gradients (their sequence-data-parallel reduction divides by DP only)
        average = not self.uses_deepspeed or not sums_over_context_parallel(
            self.state.deepspeed_plugin.deepspeed_config
        )
        # on the transformers model inside a PeftModel (whose forward calls it): its generate calls it too
        attached = hf_model(model)
        attach_context_parallel(attached, self.parallel.cp_group, self.settings.cp_comm_type, sequence_split, average)
        if os.environ.get("MEGATRON_LM_ATTENTION_BACKEND", "auto").strip().lower() not in ("", "auto"):
            self.print(
                f"mtk: context parallelism (cp = {self.parallel.cp_size}) attends with its own "
                f"{self.settings.cp_comm_type} attention, not {chosen} (megatron_lm_attention_backend)"
            )

    def _agree(self, model: nn.Module) -> None:
        """Before conversion: every rank holds rank 0's weights and its replica's source generators
        (:mod:`mtk.parallel.consistency`), whatever each process seeded."""
        world = dist.group.WORLD if dist.is_initialized() else None
        differed = agree_weights(model, world, 0, self.parallel.device)
        if differed:
            self.print(
                f"mtk: the model's weights differed between processes ({len(differed)} tensors, e.g. {differed[0]}: "
                "built from a per-process seed?); every process now holds process 0's"
            )
        self._agree_rng()

    def _agree_rng(self) -> None:
        """The replica's source generators (so replicated-region dropout and the TP stream's seed agree)."""
        agree_rng(self.parallel.batch_group, self.parallel.batch_src_rank, self.parallel.device)

    def _pipelined(self, model: nn.Module) -> nn.Module:
        """With pp > 1, the stage wrapped in the schedule-running :class:`PipelineModel`."""
        if self.parallel.pp_size == 1:
            return model
        return PipelineModel(model, self.parallel, self.settings.num_micro_batches, self.settings.pipeline_schedule)


def _refuse_unconverted_peft_model(model: nn.Module, method: str) -> None:
    """PEFT's adapters wrap the layers the conversion replaces (at any layout): one line naming the order that
    works."""
    if is_peft_model(model):
        raise ConfigError(
            f"{method}(PeftModel): PEFT's adapters wrap layers mtk has not converted; convert the base model first, "
            "then add the adapters to its parallel layers: model = mtk.lora.get_peft_model("
            "accelerator.parallelize(model), lora_config) (or peft_config= to mtk's TRL trainers)"
        )
