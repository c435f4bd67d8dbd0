"""The HF idiom ``unwrap_model(model).save_pretrained(dir, state_dict=accelerator.get_state_dict(model))``, made safe.

transformers' ``save_pretrained`` (and accelerate's ``save_model``) clean the target folder of weight shards
they would not rewrite, so saving into a folder that holds a user's ``model-00001-of-00003.safetensors`` deletes
it, and a target that is a file saves nothing without failing. Here the target must be new or empty (checked
before the run trains, see :func:`check_target`), the directory is written beside it under a staging name and
renamed into place when complete, and whatever goes wrong is one line on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from mtk.checkpoint.export import check_new_directory, staged_directory
from mtk.errors import CheckpointError

__all__ = ["check_target", "save_pretrained"]


def check_target(directory: str | Path) -> None:
    """Refuse (one line) a save target that is a file, a link, or a folder that already holds files."""
    check_new_directory(Path(directory))


def save_pretrained(accelerator: Any, model: nn.Module, directory: str | Path, tokenizer: Any = None) -> Path:
    """Write the whole model (the main process gathers it; adapters only for a PEFT model) and ``tokenizer`` as
    an HF directory at ``directory``, atomically. Collective: every rank calls it and every rank raises the same
    error if the write fails."""
    out = Path(directory)
    check_target(out)
    state = accelerator.get_state_dict(model)  # collective
    problem: list[str | None] = [None]
    if accelerator.is_main_process:
        try:
            with staged_directory(out) as tmp:
                accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state, safe_serialization=True)
                if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
                    tokenizer.save_pretrained(tmp)
        except CheckpointError as err:
            problem = [str(err)]
    if dist.is_initialized():
        dist.broadcast_object_list(problem, src=0)  # rank 0 of the world is accelerate's main process
    if problem[0] is not None:
        raise CheckpointError(problem[0])
    return out
