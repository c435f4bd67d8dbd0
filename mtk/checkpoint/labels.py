"""Each file a checkpoint writes carries the label of the save that wrote it, so a file copied in from another save
is named even where the metadata's checksums were rewritten to match it.

The checksums in ``metadata.json`` (:mod:`~mtk.checkpoint.integrity`) find a file that was damaged or swapped, but
they are only as good as the list: copy a pipeline stage's weights from ``step_2`` into ``step_4`` and record their
checksums, and every file verifies, each alone valid, the whole a model that never existed. The counts
(:mod:`~mtk.checkpoint.counts`) catch such a mix where the copied file counts something else (an optimizer's steps,
a learning rate); weights and an FSDP2 piece's moments count nothing.

So every save draws one label (its step and a random part, agreed by all ranks) and writes it into each of its own
files: the safetensors headers' metadata, the optimizer's JSON, the RNG and scheduler states, all under the key
``mtk_save``. Reading (resume, ``mtk verify-checkpoint``, ``mtk export``: all through
:func:`~mtk.checkpoint.integrity.read_verified`) compares every file's label with the metadata's ``save``. A label is
a mark against mix-ups, not a signature: whoever rewrites a file's label and its checksum can forge a checkpoint,
as they could rewrite its weights.

Files mtk does not write itself (DeepSpeed's own state, a tokenizer, accelerate's custom objects) carry no label;
checkpoints written before labels record no ``save`` and their files none, and are read as before.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open

from mtk import jsonio
from mtk.checkpoint.paths import reading
from mtk.errors import CheckpointError

__all__ = ["KEY", "file_label", "label_problem", "labelled", "new_label"]

KEY = "mtk_save"


def new_label(step: int) -> str:
    """A label for the save of ``step``, the same on every rank (rank 0 draws it). Collective."""
    drawn = [f"step_{step}-{uuid.uuid4().hex[:16]}"]
    if dist.is_initialized():
        dist.broadcast_object_list(drawn, src=0)
    return drawn[0]


def labelled(state: dict[str, Any], label: str) -> dict[str, Any]:
    """``state`` (a ``torch.save``'d dict) with the save's label."""
    return {**state, KEY: label}


def _kind(name: str) -> str | None:
    """How a file at ``name`` (relative to the checkpoint) keeps its label; ``None`` for files that keep none."""
    parts = name.split("/")
    if len(parts) == 2 and parts[0] in ("model", "optimizer") and parts[1].endswith(".safetensors"):
        return "safetensors"
    if len(parts) == 2 and parts[0] == "optimizer" and parts[1].endswith(".json"):
        return "json"
    if (len(parts) == 2 and parts[0] == "rng" and parts[1].endswith(".pt")) or (
        len(parts) == 1 and parts[0].startswith("scheduler") and parts[0].endswith(".pt")
    ):
        return "torch"
    return None


def file_label(path: Path, kind: str) -> str | None:
    """The label the file at ``path`` carries (``None``: none); one line naming the file
    (:class:`~mtk.errors.CheckpointError`) for one not readable as ``kind``."""
    with reading(path):
        if kind == "safetensors":
            try:
                with safe_open(str(path), framework="pt") as file:
                    found = (file.metadata() or {}).get(KEY)
            except Exception as err:  # safetensors raises its own types for a damaged header
                raise ValueError(f"not a readable safetensors file: {err}") from None
        elif kind == "json":
            record = jsonio.read(path)
            found = record.get(KEY) if isinstance(record, dict) else None
        else:
            state = torch.load(path, weights_only=True, map_location="cpu")
            found = state.get(KEY) if isinstance(state, dict) else None
    return found if isinstance(found, str) or found is None else repr(found)


def label_problem(root: Path, name: str, label: str | None) -> str | None:
    """What is wrong with the label of ``root / name`` against the checkpoint's ``label``; ``None`` when it matches
    (or the file is of a kind that keeps none)."""
    kind = _kind(name)
    if kind is None:
        return None
    try:
        found = file_label(root / name, kind)
    except CheckpointError as err:
        return str(err)
    if found == label:
        return None
    if label is None:
        return f"{root / name} was written by the save labelled {found!r}; this checkpoint's metadata records no label"
    if found is None:
        return (
            f"{root / name} carries no save label where this checkpoint's files carry {label!r}: written by another "
            "program or an older save, or crafted"
        )
    return (
        f"{root / name} was written by the save labelled {found!r}, not by this checkpoint's ({label!r}): copied in "
        "from another save"
    )
