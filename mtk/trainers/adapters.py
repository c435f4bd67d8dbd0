"""``peft_config=`` in mtk's TRL trainers: TRL's LoRA run, with mtk's tensor-parallel adapters.

TRL wraps the model with ``peft.get_peft_model`` before ``Trainer.__init__``, on the model as loaded. mtk's adapters
go on the converted model (:func:`mtk.lora.get_peft_model`), which exists only once the Trainer has built
``mtk.Accelerator``. So :func:`take_peft_config` takes ``peft_config`` out of what TRL sees, and
:class:`~mtk.trainers.base.ParallelTrainerMixin` adds the adapters right after converting the model
(:func:`add_adapters`): PEFT injects them into the converted model in place, and they start from the factors PEFT
draws on one process (:func:`mtk.lora.peft_initial_adapters`; TRL seeds with ``set_seed(args.seed)`` right before
its ``get_peft_model``). The Trainer's ``model`` is the ``PeftModel`` before TRL's code after ``Trainer.__init__``
looks at it, so TRL takes its own PEFT paths: its fused head on the base model, and in DPO no reference model
(the reference log-probabilities come from the same model with its adapters disabled) and ``sync_ref_model``
refused.

What TRL does around its ``get_peft_model`` and mtk does not need: ``enable_input_require_grads`` for gradient
checkpointing (mtk's recompute is non-reentrant), the bf16 cast of quantized models' adapters (mtk trains no
quantized base). What mtk cannot do is refused in one line: a ``PeftModel`` as ``model=``, LoRA on the
vocabulary-parallel head or ``modules_to_save`` on a split module (:func:`mtk.lora.get_peft_model`), and a chat
template cloned from another tokenizer (its new tokens would train in the vocabulary-parallel embedding and head).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from mtk.errors import ConfigError
from mtk.integrations.accelerate import Accelerator
from mtk.lora import get_peft_model, load_full_adapters, peft_initial_adapters
from mtk.parallel.record import is_peft_model

__all__ = ["add_adapters", "check_adapters_in_place", "refuse_peft_model", "take_peft_config"]


def refuse_peft_model(model: Any, trainer: str) -> None:
    """One line for a ``PeftModel`` given as the model: its adapters wrap layers mtk has not converted."""
    if is_peft_model(model):
        raise ConfigError(
            f"mtk.trainers.{trainer}(model=PeftModel): mtk adds its tensor-parallel adapters to the converted model; "
            "pass the base model with peft_config=model.peft_config['default'] to SFTTrainer/DPOTrainer (to continue "
            "trained adapters, use mtk.Accelerator with mtk.lora.get_peft_model and mtk.lora.load_full_adapters)"
        )


def take_peft_config(args: tuple, kwargs: dict[str, Any], trainer: str) -> Any:
    """``peft_config`` taken out of the keyword arguments TRL will see (``None`` if not given)."""
    refuse_peft_model(kwargs.get("model", args[0] if args else None), trainer)
    return kwargs.pop("peft_config", None)  # not a LoraConfig: one line from mtk.lora.get_peft_model


def add_adapters(accelerator: Accelerator, model: nn.Module, config: Any, args: Any) -> nn.Module:
    """mtk's LoRA on the converted ``model`` (in place), starting where TRL's PEFT would; returns the ``PeftModel``."""
    template = getattr(args, "chat_template_path", None)
    if template is not None and not (Path(template).is_file() and template.endswith((".jinja", ".j2"))):
        raise ConfigError(
            f"chat_template_path={template!r} with peft_config: cloning a tokenizer's chat template adds tokens that "
            "TRL trains through the embedding and lm_head, which mtk's LoRA keeps frozen; pass a .jinja template file"
        )
    plugin = getattr(args, "deepspeed_plugin", None)
    zero3 = plugin is not None and plugin.zero_stage == 3  # TRL keeps the adapters in the base's dtype then
    peft_model = get_peft_model(model, config, report=accelerator.print, autocast_adapter_dtype=not zero3)
    load_full_adapters(peft_model, peft_initial_adapters(peft_model, config, args.seed))
    return peft_model


def check_adapters_in_place(trainer: Any) -> None:
    """After ``Trainer.__init__``: its ``model`` is the ``PeftModel`` (set where it calls ``_validate_args``)."""
    adapters = getattr(trainer, "_peft_model", None)
    if adapters is not None and trainer.model is not adapters:
        raise ConfigError(
            "mtk.trainers: this transformers' Trainer.__init__ did not call _validate_args after setting its model, "
            "so the LoRA adapters were not put in place; use a transformers version mtk supports (5.x)"
        )
