"""Where each part of a training checkpoint lives: every file name in one place.

::

    step_N/
      metadata.json                   CheckpointMeta: format, step, topology, versions, model, data position
      model/tp00-pp00.safetensors     one (tp, pp) rank's parameter shards (+ each one's ShardSpec)
      model/tp00-pp00-piece00.safetensors   ... or, with FSDP2, each DP rank's flat piece of them
      optimizer/tp00-pp00.safetensors optimizer tensors keyed "<param name>::<state key>"
      optimizer/tp00-pp00.json        param groups (by parameter name) and non-tensor state
      scheduler.pt                    LR scheduler state (replicated); scheduler_1.pt, ... for more
      rng/rank00000.pt                every rank's RNG states (python, numpy, torch, device, fp16 scaler)
      custom_checkpoint_0.pt          objects registered with accelerate's register_for_checkpointing
      tokenizer/                      the run's tokenizer, when it has one (shipped by ``mtk export``)
      deepspeed/                      DeepSpeed's own state, when its engine wrote the checkpoint
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mtk.errors import CheckpointError

__all__ = ["CheckpointPaths", "reading", "shard_name"]

# What reading a file's contents raises when they are not what mtk wrote there: a pickle that torch.load's
# weights_only refuses, JSON of another shape, a state dict that does not fit the object it is loaded into.
_CONTENT_ERRORS = (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError, RuntimeError)


@contextmanager
def reading(path: Path) -> Iterator[None]:
    """Load ``path`` of a checkpoint inside this block: an error of its contents is one line naming the file.

    Checksums prove a file is the one recorded, not that mtk wrote it (metadata and checksums can be rewritten
    together), and a file from another version may not fit: such a file fails while it is parsed or loaded,
    which would otherwise be a reader's traceback (``KeyError: 'state'``, torch's weights_only refusal)."""
    try:
        yield
    except CheckpointError:
        raise
    except _CONTENT_ERRORS as err:
        if isinstance(err, pickle.UnpicklingError):
            reason = "a pickle that torch.load(weights_only=True) refuses to unpickle"
        elif isinstance(err, json.JSONDecodeError):
            reason = f"not valid JSON ({err})"
        else:
            text = str(err).strip().splitlines()
            reason = f"{type(err).__name__}: {text[0] if text else 'no message'}"
        raise CheckpointError(
            f"{path} does not hold what this run loads from it ({reason}); it was written by another program or "
            "version, or crafted: use another checkpoint"
        ) from None


def shard_name(tp_rank: int, pp_rank: int, piece: int | None = None) -> str:
    """``tp01-pp00``: the stem of one (tp, pp) rank's weights and optimizer files; ``tp01-pp00-piece03`` for the
    fourth of the pieces FSDP2 splits them into over DP."""
    return f"tp{tp_rank:02d}-pp{pp_rank:02d}" + ("" if piece is None else f"-piece{piece:02d}")


class CheckpointPaths:
    """The files of the checkpoint at ``root`` (which may still be the ``.incomplete`` directory)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @property
    def metadata(self) -> Path:
        return self.root / "metadata.json"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def deepspeed(self) -> Path:
        return self.root / "deepspeed"

    def weights(self, tp_rank: int, pp_rank: int, piece: int | None = None) -> Path:
        return self.root / "model" / f"{shard_name(tp_rank, pp_rank, piece)}.safetensors"

    def optimizer(self, tp_rank: int, pp_rank: int, index: int = 0, piece: int | None = None) -> Path:
        """The stem (``.safetensors`` for tensors, ``.json`` for groups) of optimizer ``index``'s state. The groups
        of a checkpoint saved in pieces are at the stem without one (every piece has the same)."""
        stem = shard_name(tp_rank, pp_rank, piece)
        return self.root / "optimizer" / (stem if index == 0 else f"{stem}-{index}")

    def scheduler(self, index: int = 0) -> Path:
        return self.root / ("scheduler.pt" if index == 0 else f"scheduler_{index}.pt")

    def rng(self, rank: int) -> Path:
        return self.root / "rng" / f"rank{rank:05d}.pt"

    def custom_object(self, index: int) -> Path:
        return self.root / f"custom_checkpoint_{index}.pt"

    def make_dirs(self) -> None:
        for sub in ("model", "optimizer", "rng"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
