"""TRL's ``SFTTrainer`` and ``DPOTrainer`` on mtk's layout: the same constructors and configs.

TRL computes its log-probabilities, entropy and token accuracy with a fused LM head that multiplies the hidden
states by ``lm_head.weight`` directly; under TP that weight is this rank's slice of the vocabulary, so mtk puts its
vocab-parallel head in its place (:mod:`mtk.rules.fused_head`) once TRL has added its own. The rest of TRL's
arithmetic already holds under mtk: its metrics gather over ``accelerator.gather_for_metrics`` (the data-parallel
replicas under mtk) and its ``get_tp_size`` scaling is the Trainer's (:mod:`mtk.trainers.base`).

With ``pp > 1`` the fused head runs on the last stage inside mtk's pipeline, which returns its per-token fields to
every stage; DPO's loss of whole sequences is backpropagated in two passes (:meth:`DPOTrainer._compute_loss`).

``peft_config=`` (a ``peft.LoraConfig``) trains mtk's tensor-parallel LoRA adapters, added to the converted model and
starting from the factors TRL's PEFT draws on one process, so a LoRA run logs TRL's numbers; DPO then keeps no
reference model, as TRL's own LoRA run (:mod:`mtk.trainers.adapters`). Checkpoints hold the adapters and resume
exactly; ``save_model`` writes PEFT's adapter directory.

``model=`` a local directory builds the model on the meta device and reads only this rank's slices of its weights
once converted; so is DPO's reference, TRL's copy from the same directory or ``ref_model=`` another directory
(:mod:`mtk.trainers.model_path`).

What is not exact yet is refused in one line: a ``PeftModel`` as ``model=`` (pass the base model and
``peft_config=``), DPO with ``pp > 1`` and dropout or a router loss, and SFT's ``dft`` loss with ``pp > 1``.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import datasets
import torch
import trl
import trl.trainer.dpo_trainer as trl_dpo
import trl.trainer.sft_trainer as trl_sft

from mtk.data.formats import chat_template_refusals
from mtk.errors import ConfigError, DataError
from mtk.pipeline.engine import PipelineModel
from mtk.rules.fused_head import replace_trl_fused_head
from mtk.trainers.adapters import check_adapters_in_place, take_peft_config
from mtk.trainers.base import ParallelTrainerMixin
from mtk.trainers.model_path import PathLoader, take_reference_directory, trl_loading

__all__ = ["DPOTrainer", "SFTTrainer"]


def _argument(args: tuple | list, kwargs: dict[str, Any], name: str, position: int) -> Any:
    """A constructor argument given by name or by position (``None`` if not given)."""
    return kwargs.get(name, args[position] if len(args) > position else None)


def _check_preference_columns(dataset: Any, which: str) -> None:
    """DPO's rows need ``chosen`` and ``rejected``: one line naming the missing column (TRL's KeyError came from
    inside its tokenization); a dict of evaluation sets is checked set by set."""
    if isinstance(dataset, dict):
        for name, part in dataset.items():
            _check_preference_columns(part, f"{which}[{name!r}]")
        return
    columns = getattr(dataset, "column_names", None)  # (an iterable dataset may not know its columns)
    if not columns:
        return
    missing = [column for column in ("chosen", "rejected") if column not in columns]
    if missing:
        raise DataError(
            f"DPOTrainer's {which} has no {missing[0]!r} column (it has {', '.join(columns)}); DPO rows need 'chosen' "
            "and 'rejected' (with a 'prompt', or the prompt at the start of both)"
        )


def _check_conversations(dataset: Any, which: str, columns: tuple[str, ...]) -> None:
    """Conversational rows, checked before TRL reads them: a column of ``columns`` that holds messages must hold, in
    every row, a non-empty list of ``{role, content}`` (content a string, a list of parts, or null beside
    ``tool_calls``; ``messages`` is always a list); otherwise one line naming the row. TRL's own failures were an
    ``IndexError`` (an empty list), a ``KeyError: 'text'`` (``messages`` a string) and a template's ``TypeError``. A
    dict of evaluation sets is checked set by set; an iterable dataset (read lazily) is left to TRL."""
    if isinstance(dataset, dict):
        for name, part in dataset.items():
            _check_conversations(part, f"{which}[{name!r}]", columns)
        return
    if not isinstance(dataset, datasets.Dataset):  # a stream (IterableDataset) would be read whole here
        return
    present = dataset.column_names or []
    for column in (c for c in columns if c in present):
        for row, value in enumerate(dataset[column]):
            if isinstance(value, str) and column != "messages":
                continue  # TRL's standard (not conversational) format
            if not isinstance(value, list) or not value:
                kinds = "a non-empty list of {role, content} messages"
                kinds = kinds if column == "messages" else f"text or {kinds}"
                raise DataError(f"{which} row {row}: {column!r} must be {kinds}, got {str(value)[:80]!r}")
            for turn in value:
                content = turn.get("content") if isinstance(turn, dict) else None
                tool_call = content is None and isinstance(turn, dict) and bool(turn.get("tool_calls"))
                if (
                    not isinstance(turn, dict)
                    or not isinstance(turn.get("role"), str)
                    or not (isinstance(content, (str, list)) or tool_call)
                ):
                    raise DataError(
                        f"{which} row {row}: every message needs a string 'role' and a 'content' (a string, a list "
                        f"of parts, or null beside 'tool_calls'), got {str(turn)[:120]}"
                    )


def _check_implicit_prompts(dataset: Any, which: str) -> None:
    """DPO rows without a ``prompt`` column take the prompt from the messages ``chosen`` and ``rejected`` start with
    alike; rows whose first messages differ leave none, and TRL failed on the empty prompt with an ``IndexError``."""
    if isinstance(dataset, dict):
        for name, part in dataset.items():
            _check_implicit_prompts(part, f"{which}[{name!r}]")
        return
    if not isinstance(dataset, datasets.Dataset) or "prompt" in (dataset.column_names or []):
        return
    if not {"chosen", "rejected"} <= set(dataset.column_names or []):
        return  # (_check_preference_columns names the missing one)
    for row, (chosen, rejected) in enumerate(zip(dataset["chosen"], dataset["rejected"])):
        if isinstance(chosen, list) and isinstance(rejected, list) and chosen[:1] != rejected[:1]:
            raise DataError(
                f"{which} row {row}: 'chosen' and 'rejected' start with different messages, so no prompt can be taken "
                "from them; give a 'prompt' column, or start both with the same prompt"
            )


def _refuse_cloned_template(model: Any, config: Any) -> None:
    """TRL clones another tokenizer's chat template by resizing the embeddings of the model as loaded; a model
    given by path is read slice by slice only after its conversion, at its saved size."""
    template = getattr(config, "chat_template_path", None)
    if not isinstance(model, str) or template is None:
        return
    if not (Path(template).is_file() and template.endswith((".jinja", ".j2"))):
        raise ConfigError(
            f"SFTConfig.chat_template_path={template!r} with model= a directory: cloning a tokenizer's chat template "
            "resizes the embeddings, which mtk reads slice by slice at their saved size; pass a .jinja template file, "
            "or the loaded model (model=AutoModelForCausalLM.from_pretrained(...))"
        )


def _refuse_unverified(args: Any, trainer: str) -> None:
    """TRL options that reach into the model or its reference in ways mtk has not made exact yet: one line each."""
    problems = {
        "activation_offloading": "it moves activations mtk's recompute manages; use megatron_lm_recompute_*",
        "sync_ref_model": "the reference is synced from the policy parameter by parameter, untested on shards",
        "precompute_ref_log_probs": "the reference pass over the data set is not verified under mtk yet",
    }
    for name, why in problems.items():
        if getattr(args, name, False):
            raise ConfigError(f"{type(args).__name__}.{name}=True with mtk.trainers.{trainer}: {why}; leave it off")


def _check_documented_choices(args: Any) -> None:
    """``DPOConfig.loss_type`` and ``f_divergence_type``: TRL checks the names only inside the first step's loss (a
    ``ValueError`` traceback on every rank, after the model was loaded and the data prepared), so each is checked
    first against the values its field's help lists before its first full stop (none found: nothing is refused)."""
    fields = {f.name: f for f in dataclasses.fields(args)} if dataclasses.is_dataclass(args) else {}
    for name, what in (("loss_type", "a loss"), ("f_divergence_type", "an f-divergence")):
        if name not in fields:
            continue
        listed = fields[name].metadata.get("help", "").split("Possible values are:")[-1].split(". ")[0]
        allowed = re.findall(r"`'?(\w+)'?`", listed)
        value = getattr(args, name)
        given = value if isinstance(value, (list, tuple)) else [value]
        unknown = [choice for choice in given if choice not in allowed]
        if allowed and unknown:
            wrong = f"{type(args).__name__}.{name} {unknown[0]!r}"
            raise ConfigError(f"{wrong} is not {what} TRL knows; use one of {allowed}")


def _check_sft_columns(dataset: Any, which: str, config: Any, formatted: bool) -> None:
    """Rows SFTTrainer can read, checked before TRL reads them: tokenized rows (``input_ids``) when
    ``dataset_kwargs`` skips TRL's preparation (TRL's was a ``ValueError`` about the model's forward once training
    began); otherwise ``messages``, ``prompt`` or the ``dataset_text_field`` column (TRL's was a ``KeyError``).
    A ``formatting_func`` makes its own text; a dict of evaluation sets is checked set by set."""
    if isinstance(dataset, dict):
        for name, part in dataset.items():
            _check_sft_columns(part, f"{which}[{name!r}]", config, formatted)
        return
    columns = getattr(dataset, "column_names", None)  # (an iterable dataset may not know its columns)
    if not columns or formatted:
        return
    kwargs = getattr(config, "dataset_kwargs", None) or {}
    if not isinstance(kwargs, dict):
        raise ConfigError(f"SFTConfig.dataset_kwargs must be a JSON mapping, e.g. {{\"skip_prepare_dataset\": true}}, "
                          f"not {str(kwargs)[:60]!r}")  # fmt: skip
    skipping = bool(kwargs.get("skip_prepare_dataset"))
    if skipping and "input_ids" not in columns:
        raise DataError(
            f"SFTConfig.dataset_kwargs skip_prepare_dataset=True needs tokenized rows ('input_ids'), but {which} has "
            f"{', '.join(columns)}; leave it unset and TRL tokenizes them"
        )
    text_field = getattr(config, "dataset_text_field", "text")
    if not skipping and not {"input_ids", "messages", "prompt", text_field} & set(columns):
        raise DataError(
            f"SFTTrainer's {which} has no {text_field!r} column (SFTConfig.dataset_text_field) and no 'messages' or "
            f"'prompt' (it has {', '.join(columns)}); name a column of the rows"
        )


def _check_template_path(config: Any) -> None:
    """``SFTConfig.chat_template_path`` that is neither a file nor a folder: one line naming it (TRL then read it as
    a Hub repository id, and failed with the Hub's ``OSError``). A name that could be a repository is left to TRL."""
    template = getattr(config, "chat_template_path", None)
    if template is None or Path(template).exists():
        return
    if template.endswith((".jinja", ".j2")) or template.startswith((".", "/", "~")) or template.count("/") > 1:
        raise ConfigError(
            f"SFTConfig.chat_template_path={template!r}: no such file or folder; give a .jinja template file or a "
            "tokenizer's folder"
        )


class SFTTrainer(ParallelTrainerMixin, trl.SFTTrainer):
    """TRL's ``SFTTrainer`` (``SFTConfig``, ``peft_config``) at any TP x PP x DP layout."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._peft_config = take_peft_config(args, kwargs, "SFTTrainer")
        config = _argument(args, kwargs, "args", 1)
        _refuse_unverified(config, "SFTTrainer")
        _check_template_path(config)
        _refuse_cloned_template(_argument(args, kwargs, "model", 0), config)
        formatted = _argument(args, kwargs, "formatting_func", 14) is not None
        for name, position in (("train_dataset", 3), ("eval_dataset", 4)):
            dataset = _argument(args, kwargs, name, position)
            _check_conversations(dataset, name, ("messages", "prompt", "completion"))
            _check_sft_columns(dataset, name, config, formatted)
        self._path_loader = PathLoader(self, trl_sft.create_model_from_path)
        with trl_loading(trl_sft, self._path_loader), chat_template_refusals("SFTTrainer's data"):
            super().__init__(*args, **kwargs)
        check_adapters_in_place(self)
        if self.accelerator.parallel.pp_size > 1:
            _check_sft_pipeline(self)
        replace_trl_fused_head(self.model)

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """TRL's. A pipeline backpropagates inside its forward, so it is given the step's token count that TRL
        divides by afterwards: the loss it backpropagates is then TRL's (a token mean over the whole step)."""
        if isinstance(model, PipelineModel) and num_items_in_batch is not None:
            inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class DPOTrainer(ParallelTrainerMixin, trl.DPOTrainer):
    """TRL's ``DPOTrainer`` (``DPOConfig``, ``peft_config``) at any TP x PP x DP layout; the reference model is
    converted to the same layout (a frozen copy, as TRL keeps one; none with ``peft_config``: the adapters are
    disabled)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._peft_config = take_peft_config(args, kwargs, "DPOTrainer")
        _refuse_unverified(_argument(args, kwargs, "args", 2), "DPOTrainer")  # (model, ref_model, args, ...)
        if _argument(args, kwargs, "args", 2) is not None:
            _check_documented_choices(_argument(args, kwargs, "args", 2))
        _check_preference_columns(_argument(args, kwargs, "train_dataset", 4), "train_dataset")
        _check_preference_columns(_argument(args, kwargs, "eval_dataset", 5), "eval_dataset")
        for name, position in (("train_dataset", 4), ("eval_dataset", 5)):
            _check_conversations(_argument(args, kwargs, name, position), name, ("prompt", "chosen", "rejected"))
            _check_implicit_prompts(_argument(args, kwargs, name, position), name)
        given = list(args)
        reference = take_reference_directory(given, kwargs, self._peft_config)
        self._path_loader = PathLoader(self, trl_dpo.create_model_from_path, reference)
        with trl_loading(trl_dpo, self._path_loader), chat_template_refusals("DPOTrainer's data"):
            super().__init__(*given, **kwargs)
        check_adapters_in_place(self)
        if self.accelerator.parallel.pp_size > 1:
            _check_dpo_pipeline(self)
        replace_trl_fused_head(self.model)
        if self.ref_model is not None:
            replace_trl_fused_head(self.ref_model)
            # TRL prepared it for evaluation; it is frozen and not part of the checkpoint (as in TRL's own)
            models = self.accelerator._models
            models[:] = [m for m in models if m is not self.ref_model]

    def _compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool) -> Any:
        """TRL's, and with a pipeline in training its gradient in two passes. DPO's loss is a function of whole
        sequences' log-probabilities, which a pipeline's micro-batches do not see together. So TRL's own code runs
        on the log-probabilities of a forward-only pass (every stage gets them back), made a leaf: its loss and
        metrics are TRL's, and its backward gives each token's weight, d loss / d log_prob. The pipeline then
        backpropagates sum(weight x log_prob), whose gradient is the loss's (the weights are constants)."""
        if not isinstance(model, PipelineModel) or not torch.is_grad_enabled():
            return super()._compute_loss(model, inputs, return_outputs)
        seen: dict[str, Any] = {}

        def forward_only(**kwargs: Any) -> Any:
            with torch.no_grad():
                outputs = model(**kwargs)
            outputs.log_probs = outputs.log_probs.detach().requires_grad_(True)  # [2b, s']: the leaf
            seen.update(kwargs=kwargs, log_probs=outputs.log_probs)
            return outputs

        result = super()._compute_loss(forward_only, inputs, return_outputs)
        loss = result[0] if return_outputs else result
        leaf = seen["log_probs"]
        weights = torch.autograd.grad(loss, leaf)[0] if loss.requires_grad else torch.zeros_like(leaf)  # [2b, s']
        model(**seen["kwargs"], token_weights=weights)  # forward and backward, through the pipeline's schedule
        detached = loss.detach()
        return (detached, result[1]) if return_outputs else detached


def _numeric_dropouts(model: Any) -> list[str]:
    """Dropout probabilities above 0 that modules keep as numbers (``LlamaAttention.attention_dropout=0.1``), which
    TRL's ``disable_dropout`` leaves on: it zeroes ``nn.Dropout`` modules only."""
    found = []
    for module in model.modules() if isinstance(model, torch.nn.Module) else ():
        for name, value in vars(module).items():
            if ("dropout" in name or "pdrop" in name) and isinstance(value, float) and value > 0:
                found.append(f"{type(module).__name__}.{name}={value}")
    return found


def _check_sft_pipeline(trainer: Any) -> None:
    """What a pipeline's SFT computes as TRL does: it backpropagates the model's own token-mean loss, inside the
    pipeline's forward, over micro-batches it cuts from rows."""
    if trainer.args.loss_type != "nll":
        raise ConfigError(
            f"SFTConfig.loss_type={trainer.args.loss_type!r} with pp > 1: the pipeline backpropagates the model's "
            "own token-mean loss; use loss_type='nll' or pp = 1"
        )
    if trainer.padding_free:
        raise ConfigError(
            "SFTConfig packing (BFD) or padding_free with pp > 1: a padding-free batch is one row of packed "
            "examples, which the pipeline cannot cut into micro-batches; use packing=False or pp = 1"
        )
    if trainer.aux_loss_enabled:
        raise ConfigError(
            "a MoE router loss (output_router_logits, router_aux_loss_coef) with SFTTrainer at pp > 1: TRL adds the "
            "router term divided by the accumulation steps, the pipeline backpropagates the model's own loss, whose "
            "term it scales as the token loss (dp x accumulation times TRL's); set router_aux_loss_coef=0.0 in the "
            "SFTConfig, or use pp = 1"
        )


def _check_dpo_pipeline(trainer: Any) -> None:
    """What the two-pass pipeline gradient (:meth:`DPOTrainer._compute_loss`) needs: the same forward twice
    (no dropout: the passes draw differently) and a loss of the log-probabilities alone (no MoE router loss)."""
    if not trainer.args.disable_dropout:
        raise ConfigError(
            "DPOConfig.disable_dropout=False with pp > 1: mtk's pipeline DPO runs each policy forward twice (its "
            "log-probabilities, then the gradient), which dropout would make differ; keep disable_dropout=True or "
            "use pp = 1"
        )
    left_on = _numeric_dropouts(getattr(trainer, "model", None))
    if left_on:
        raise ConfigError(
            f"DPOConfig.disable_dropout=True leaves {left_on[0]} on (TRL zeroes nn.Dropout modules; attention "
            "draws with the probability it keeps), and mtk's pipeline DPO at pp > 1 runs each policy forward twice, "
            "which that dropout would make differ; set it to 0 in the model's config (attention_dropout), or use "
            "pp = 1"
        )
    if trainer.aux_loss_enabled:
        raise ConfigError(
            "a MoE router loss (output_router_logits) with DPO at pp > 1: the pipeline backpropagates the "
            "log-probabilities' part of the loss only; use pp = 1"
        )
    if trainer._peft_config is not None:  # (TRL's reference pass calls the PEFT model itself: one stage, no pipeline)
        raise ConfigError(
            "DPOTrainer with peft_config at pp > 1: TRL computes the reference by calling the adapters' model with "
            "them disabled, outside the pipeline, which mtk has not wired yet; use pp = 1 (TP and DP work), or "
            "train without peft_config"
        )
