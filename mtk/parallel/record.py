"""What :func:`mtk.parallelize` did to a model, attached to it: :class:`Parallelized`; and where the HF model
sits inside a PEFT wrapper.

The record lives here, below the rules, the pipeline and the conversion that fill it, because everything
above them reads it: the pipeline engine, checkpoints, LoRA, the Accelerator, the planner. Its fields' types
come from those layers (a :class:`~mtk.rules.base.RuleSet`, a :class:`~mtk.pipeline.stages.StageInfo`); they
are named for the type checker only, so reading a record imports nothing above ``mtk.parallel``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from mtk.parallel.random import RNGStreams

if TYPE_CHECKING:
    from mtk.pipeline.stages import StageInfo
    from mtk.rules.base import RuleSet

__all__ = ["Parallelized", "adapter_configs", "attach", "hf_model", "is_peft_model", "parallelized"]

_ATTRIBUTE = "mtk_parallelized"


@dataclass(frozen=True)
class Parallelized:
    """What :func:`~mtk.convert.parallelize` did to a model.

    Attributes:
        rule_set: the rules that converted it (a family's, or the parity-checked generic ones).
        tp_size: the tensor-parallel degree its shards were cut for.
        stage: the pipeline stage it holds; ``None`` when it was not cut (pp = 1).
        sequence_parallel: its blocks run on sequence-split activations (:mod:`mtk.convert.regions`).
        rng: the random streams its dropouts draw from (the TP stream is checkpointed with the model).
    """

    rule_set: RuleSet
    tp_size: int
    stage: StageInfo | None
    sequence_parallel: bool = False
    rng: RNGStreams | None = field(default=None, compare=False)

    @property
    def pp_size(self) -> int:
        return self.stage.num_stages if self.stage else 1


def attach(model: nn.Module, record: Parallelized) -> None:
    """Record on ``model`` what converted it (read back with :func:`parallelized`)."""
    setattr(model, _ATTRIBUTE, record)


def parallelized(model: nn.Module) -> Parallelized | None:
    """The record :func:`~mtk.convert.parallelize` attached to ``model``, or ``None`` for a model it never saw."""
    return getattr(model, _ATTRIBUTE, None)


def is_peft_model(model: nn.Module) -> bool:
    """A PEFT ``PeftModel`` (duck-typed: the training path never needs to import peft)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a ``PeftModel`` (with its LoRA layers); any other model as is."""
    return cast(Any, model).get_base_model() if is_peft_model(model) else model


def adapter_configs(model: nn.Module) -> dict[str, dict[str, Any]]:
    """A ``PeftModel``'s adapter configs by adapter name, as JSON (what ``adapter_config.json`` holds)."""
    configs = {}
    for name, config in cast(Any, model).peft_config.items():
        record = config.to_dict()
        configs[name] = {k: sorted(v) if isinstance(v, set) else v for k, v in record.items()}
    return json.loads(json.dumps(configs, default=str))
