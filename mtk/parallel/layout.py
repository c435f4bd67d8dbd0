"""Megatron's rank layout as a pure function of (world size, tp, pp).

Ranks are laid out tensor-parallel fastest, then data-parallel, then pipeline-parallel: the global
rank grid is ``range(world).reshape(pp, dp, tp)`` and every kind of group is one slice of it. TP
groups are therefore runs of consecutive ranks (they all-reduce every layer, so they should share a
node), while PP groups stride across the whole world (they only exchange small P2P messages).

Nothing here touches torch.distributed, so the layout of a 1,024-rank job can be checked in a unit
test without launching a single process.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtk.errors import LayoutError

__all__ = ["LayoutError", "Coords", "Layout"]


@dataclass(frozen=True)
class Coords:
    """One rank's position in the grid."""

    tp_rank: int
    dp_rank: int
    pp_rank: int


@dataclass(frozen=True)
class Layout:
    """The rank grid for ``world_size`` processes split into TP x DP x PP.

    Attributes:
        world_size: total number of processes.
        tp_size: tensor-parallel degree (ranks that split each layer's weights).
        pp_size: pipeline-parallel degree (ranks that split the stack of layers).
    """

    world_size: int
    tp_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp_size", "pp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        model_parallel = self.tp_size * self.pp_size
        if self.world_size % model_parallel:
            valid = [n for n in range(1, self.world_size + 1) if self.world_size % n == 0]
            raise LayoutError(
                f"world size {self.world_size} is not divisible by tp*pp = {self.tp_size}*{self.pp_size} = "
                f"{model_parallel}; tp*pp must divide the world size (divisors of {self.world_size}: {valid})"
            )

    @property
    def dp_size(self) -> int:
        """Number of model replicas (data-parallel degree)."""
        return self.world_size // (self.tp_size * self.pp_size)

    def coords(self, rank: int) -> Coords:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside the world of {self.world_size} processes")
        tp_rank = rank % self.tp_size
        dp_rank = (rank // self.tp_size) % self.dp_size
        pp_rank = rank // (self.tp_size * self.dp_size)
        return Coords(tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=pp_rank)

    def rank_at(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """Global rank at the given coordinates (inverse of :meth:`coords`)."""
        return (pp_rank * self.dp_size + dp_rank) * self.tp_size + tp_rank

    # Each kind of group fixes all coordinates but the ones it spans.
    def tp_groups(self) -> list[list[int]]:
        return [
            [self.rank_at(t, d, p) for t in range(self.tp_size)]
            for p in range(self.pp_size)
            for d in range(self.dp_size)
        ]

    def dp_groups(self) -> list[list[int]]:
        return [
            [self.rank_at(t, d, p) for d in range(self.dp_size)]
            for p in range(self.pp_size)
            for t in range(self.tp_size)
        ]

    def pp_groups(self) -> list[list[int]]:
        return [
            [self.rank_at(t, d, p) for p in range(self.pp_size)]
            for d in range(self.dp_size)
            for t in range(self.tp_size)
        ]

    def model_parallel_groups(self) -> list[list[int]]:
        """TP x PP groups: every rank that holds a piece of one model replica."""
        return [
            [self.rank_at(t, d, p) for p in range(self.pp_size) for t in range(self.tp_size)]
            for d in range(self.dp_size)
        ]

    def embedding_groups(self) -> list[list[int]]:
        """First and last stage of each pipeline: they hold the tied input/output embeddings."""
        return [sorted({group[0], group[-1]}) for group in self.pp_groups()]

    def groups(self, kind: str) -> list[list[int]]:
        """All groups of one kind: ``tp``, ``dp``, ``pp``, ``mp`` (model-parallel) or ``embedding``."""
        builders = {
            "tp": self.tp_groups,
            "dp": self.dp_groups,
            "pp": self.pp_groups,
            "mp": self.model_parallel_groups,
            "embedding": self.embedding_groups,
        }
        if kind not in builders:
            raise LayoutError(f"unknown group kind {kind!r}; expected one of {sorted(builders)}")
        return builders[kind]()

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The group of ``kind`` that contains ``rank``; empty for embedding groups it is not in."""
        for group in self.groups(kind):
            if rank in group:
                return group
        return []
