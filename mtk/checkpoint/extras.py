"""What a checkpoint carries beside the weights for ``mtk export`` to ship: the run's tokenizer and the model's
generation config (eos ids, sampling defaults). Without them an exported model generates with transformers'
defaults and stops only at its config's single eos. Written by rank 0 into the checkpoint being saved (the
``writers`` of :func:`~mtk.checkpoint.sharded.save_checkpoint` and of the DeepSpeed save)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from mtk.checkpoint.paths import CheckpointPaths
from mtk.parallel.record import hf_model

__all__ = ["write_generation_config", "write_tokenizer"]


def write_generation_config(model: nn.Module, directory: Path) -> None:
    """``model``'s ``generation_config.json`` as set: transformers' own save validates strictly and refuses a value
    that ``generate()`` only warns of (a temperature without sampling)."""
    hf: Any = hf_model(model)
    generation = getattr(hf, "generation_config", None)
    if generation is not None and hf.can_generate():
        generation.to_json_file(str(Path(directory) / "generation_config.json"))


def write_tokenizer(tokenizer: Any, directory: Path) -> None:
    tokenizer.save_pretrained(str(CheckpointPaths(directory).tokenizer))
