"""Examples to batches: packed rows, or padded batches, and the count a token-weighted loss divides by.

Packing (``pack``) lays examples end to end in rows of exactly ``seq_len`` tokens with ``position_ids``
restarting at 0 for every example and no attention mask: transformers then builds a block-diagonal
causal mask from the position ids (``find_packed_sequence_indices`` in its masking utils), so no token
attends across examples, and an example's logits are those it has alone. The first label of each
example is -100 (as ``DataCollatorWithFlattening``'s separator), so no token learns to predict the
next example; the row's tail is padding, a sequence of its own with labels -100.

Without packing, :class:`PadToLongest` pads a batch to its longest example (right side, attention mask
0, labels -100).
"""

from __future__ import annotations

from typing import Any

import torch
from datasets import Dataset

from mtk.data.formats import IGNORE_INDEX

__all__ = ["PadToLongest", "eval_batches", "loss_tokens", "pack"]


def _pack_batch(batch: dict[str, list], *, seq_len: int, pad_id: int) -> dict[str, list]:
    rows: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []

    def close_row() -> None:
        tail = seq_len - len(ids)
        rows["input_ids"].append(ids + [pad_id] * tail)
        rows["labels"].append(labels + [IGNORE_INDEX] * tail)
        rows["position_ids"].append(positions + list(range(tail)))

    for example_ids, example_labels in zip(batch["input_ids"], batch["labels"], strict=True):
        if ids and len(ids) + len(example_ids) > seq_len:  # first fit, in order: deterministic
            close_row()
            ids, labels, positions = [], [], []
        ids = ids + list(example_ids)
        labels = labels + [IGNORE_INDEX] + list(example_labels[1:])
        positions = positions + list(range(len(example_ids)))
    if ids:
        close_row()
    return rows


def pack(examples: Dataset, seq_len: int, pad_id: int) -> Dataset:
    """Rows of ``seq_len`` tokens holding whole examples (each at most ``seq_len``, see ``tokenize_examples``)."""
    return examples.map(
        _pack_batch,
        batched=True,
        batch_size=1000,
        remove_columns=examples.column_names,
        fn_kwargs=dict(seq_len=seq_len, pad_id=pad_id),
        desc="pack",
    ).with_format("torch")


class PadToLongest:
    """``collate_fn``: pad ``input_ids`` (with ``pad_id``), ``labels`` (-100) and an ``attention_mask`` to the
    longest example of the batch, rounded up to ``multiple_of`` (sequence parallelism splits the sequence
    over TP ranks; the extra positions are masked, so the loss is unchanged); packed rows (with
    ``position_ids``) are stacked as they are."""

    def __init__(self, pad_id: int, multiple_of: int = 1) -> None:
        self.pad_id, self.multiple_of = pad_id, multiple_of

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if "position_ids" in features[0]:  # packed: every row is seq_len already
            return {key: torch.stack([torch.as_tensor(f[key]) for f in features]) for key in features[0]}
        longest = -(-max(len(f["input_ids"]) for f in features) // self.multiple_of) * self.multiple_of
        batch = {
            "input_ids": torch.full((len(features), longest), self.pad_id, dtype=torch.long),  # [b, s]
            "labels": torch.full((len(features), longest), IGNORE_INDEX, dtype=torch.long),  # [b, s]
            "attention_mask": torch.zeros((len(features), longest), dtype=torch.long),  # [b, s]
        }
        for row, feature in enumerate(features):
            n = len(feature["input_ids"])
            batch["input_ids"][row, :n] = torch.as_tensor(feature["input_ids"])
            batch["labels"][row, :n] = torch.as_tensor(feature["labels"])
            batch["attention_mask"][row, :n] = 1
        return batch


def loss_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """How many tokens of ``batch`` carry a loss: labels other than -100 after HF's shift by one (or the
    ``shift_labels`` given, which HF's loss then takes as they are)."""
    if batch.get("shift_labels") is not None:
        return (batch["shift_labels"] != IGNORE_INDEX).sum()
    return (batch["labels"][..., 1:] != IGNORE_INDEX).sum()


def eval_batches(
    examples: Dataset, collate: PadToLongest, batch_size: int, dp_rank: int, dp_size: int
) -> list[dict[str, torch.Tensor]]:
    """This data-parallel replica's evaluation batches: every example exactly once over the replicas.

    Replica r takes examples r, r + dp, ...; every replica gets the same number of full batches (what
    DDP's buffer broadcast, ZeRO-3's gathers and a pipeline's micro-batch split need), filled up with
    copies of an example whose labels are all -100, which add no loss and no token. (accelerate's
    ``even_batches`` repeats real examples instead, which would count them twice in a token mean.)
    """
    per_replica = -(-len(examples) // dp_size)  # ceil
    slots = -(-per_replica // batch_size) * batch_size
    mine = [examples[i] for i in range(dp_rank, len(examples), dp_size)]
    filler = {**examples[0], "labels": [IGNORE_INDEX] * len(examples[0]["labels"])}
    mine += [filler] * (slots - len(mine))
    return [collate(mine[start : start + batch_size]) for start in range(0, slots, batch_size)]
