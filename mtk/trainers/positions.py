"""A batch longer than a model's learned positions, said in one line before the forward.

A model with a table of learned position embeddings (GPT-2's ``wpe``, OPT's and BioGPT's ``embed_positions``,
BERT's ``position_embeddings``) has no row for a position past its table: a batch that reaches one fails deep in
``torch.embedding`` with an ``IndexError`` on every rank. TRL truncates rows to its config's ``max_length`` (1024
by default, past a tiny model's positions), so a longer row reaches the model. Rotary and ALiBi models have no
table and run past their trained length as one process does; they are not checked.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mtk.errors import ConfigError

__all__ = ["check_batch_positions", "learned_position_limit"]

_POSITION_TABLE = re.compile(r"(^|\.)(wpe|embed_positions|position_embeddings)$")


def learned_position_limit(model: nn.Module) -> int | None:
    """The number of positions ``model``'s learned position table holds (``config.max_position_embeddings`` or
    GPT-2's ``n_positions``), or ``None`` for a model without one. Collective where a process group exists: a
    pipeline's later stages hold no table, and every rank must refuse the same batch."""
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    held = any(_POSITION_TABLE.search(name) and isinstance(m, nn.Embedding) for name, m in model.named_modules())
    if dist.is_initialized():
        found: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(found, held)
        held = any(found)
    return limit if held and isinstance(limit, int) else None


def check_batch_positions(inputs: dict[str, Any], limit: int | None, args: Any) -> None:
    """One line when the batch ``inputs`` reaches a position past ``limit`` (its ``position_ids``, else its
    length: a padding-free batch's packed rows restart their positions)."""
    if limit is None:
        return
    positions = inputs.get("position_ids")
    ids = inputs.get("input_ids")
    if isinstance(positions, torch.Tensor) and positions.numel():
        reached = int(positions.max()) + 1
    elif isinstance(ids, torch.Tensor) and ids.dim() == 2:
        reached = ids.shape[1]
    else:
        return
    if reached > limit:
        length = getattr(args, "max_length", None)
        field = f"{type(args).__name__}.max_length={length}" if length is not None else "the collator's rows"
        raise ConfigError(
            f"a batch reaches position {reached}, past the model's {limit} learned positions ({field} lets rows "
            f"that long through): truncate rows to at most {limit} tokens (max_length={limit})"
        )
