"""A batch longer than a model's learned positions, said in one line before the forward.

A model with a table of learned position embeddings (GPT-2's ``wpe``, OPT's and BioGPT's ``embed_positions``,
BERT's ``position_embeddings``) has no row for a position past its table: a batch that reaches one fails deep in
``torch.embedding`` with an ``IndexError`` on every rank. TRL truncates rows to its config's ``max_length`` (1024
by default, past a tiny model's positions), so a longer row reaches the model. Rotary and ALiBi models have no
table and run past their trained length as one process does; they are not checked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mtk.errors import ConfigError

__all__ = ["PositionTable", "check_batch_positions", "learned_positions"]

_POSITION_TABLE = re.compile(r"(^|\.)(wpe|embed_positions|position_embeddings)$")


@dataclass(frozen=True)
class PositionTable:
    """A model's table of learned positions: how many it holds, and whether a row's positions count its attended
    tokens (OPT's and BioGPT's, from the attention mask: padding takes none) rather than its length."""

    limit: int
    from_mask: bool


def learned_positions(model: nn.Module) -> PositionTable | None:
    """``model``'s table of learned positions (``config.max_position_embeddings`` or GPT-2's ``n_positions`` of
    them), or ``None`` for a model without one. Collective where a process group exists: a pipeline's later stages
    hold no table, and every rank must refuse the same batch."""
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    tables = [m for name, m in model.named_modules() if _POSITION_TABLE.search(name) and isinstance(m, nn.Embedding)]
    mine = (bool(tables), any(type(m).__name__.endswith("LearnedPositionalEmbedding") for m in tables))
    found: list[Any] = [mine]
    if dist.is_initialized():
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
    if not any(held for held, _ in found) or not isinstance(limit, int):
        return None
    return PositionTable(limit, any(from_mask for _, from_mask in found))


def _reached(inputs: Any, table: PositionTable) -> int:
    """The number of positions the batch ``inputs`` takes (0: none it can tell)."""
    get = getattr(inputs, "get", None)
    if get is None:
        return 0
    positions, mask = get("position_ids"), get("attention_mask")
    if isinstance(positions, torch.Tensor) and positions.numel():
        return int(positions.max()) + 1  # (a padding-free batch's packed rows restart their positions)
    if table.from_mask and isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.numel():
        return int(mask.sum(-1).max())
    for name, dims in (("input_ids", 2), ("inputs_embeds", 3)):
        given = get(name)
        if isinstance(given, torch.Tensor) and given.dim() == dims:
            return given.shape[1]
    return 0


def check_batch_positions(inputs: Any, table: PositionTable | None, args: Any, device: torch.device) -> None:
    """One line, on every rank, when the batch ``inputs`` of any rank reaches a position past the table's
    (collective where a process group exists: data-parallel replicas draw other batches, and one refusing alone
    would leave the others in the gradient's all-reduce)."""
    if table is None:
        return
    reached = _reached(inputs, table)
    if dist.is_initialized():
        longest = torch.tensor([reached], dtype=torch.long, device=device)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        reached = int(longest.item())
    if reached > table.limit:
        length = getattr(args, "max_length", None)
        fix = (
            f"{type(args).__name__}.max_length={length} lets rows that long through: set it to at most {table.limit}"
            if length is not None
            else f"truncate the rows your data or collator builds to at most {table.limit} tokens"
        )
        raise ConfigError(
            f"a batch reaches position {reached}, past the model's {table.limit} learned positions; {fix}"
        )
