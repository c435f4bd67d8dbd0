"""Megatron's rank layout as a pure function of (world size, tp, cp, pp).

Ranks are laid out tensor-parallel fastest, then context-parallel, then data-parallel, then
pipeline-parallel (Megatron-Core's order): the global rank grid is ``range(world).reshape(pp, dp, cp, tp)``
and every kind of group is one slice of it. TP groups are therefore runs of consecutive ranks (they
all-reduce every layer, so they should share a node), CP groups next (they pass keys and values every
layer), while PP groups stride across the whole world (they only exchange small P2P messages).

A CP group's ranks hold the same weights and split each sequence between them, so the ranks that
reduce gradients and share optimizer state are the DP x CP *replica* group (Megatron's data-parallel
group "with context parallel", DeepSpeed's sequence-data-parallel group); data is split over DP only.

Expert parallelism (EP) is carved out of the replica ranks, as in Megatron-Core with the experts' TP equal to TP:
each replica group (ordered DP outer, CP inner) is cut into runs of ``ep`` consecutive ranks that hold different
experts of every MoE layer (the ``ep`` groups), and the ranks at the same place in every run hold the same experts
(the ``expert_replica`` groups, Megatron's expert-data-parallel: the experts' gradients are reduced over them).

Nothing here touches torch.distributed, so the layout of a 1,024-rank job can be checked in a unit
test without launching a single process.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from mtk.errors import LayoutError

__all__ = ["LayoutError", "Coords", "Layout"]


@dataclass(frozen=True)
class Coords:
    """One rank's position in the grid."""

    tp_rank: int
    dp_rank: int
    pp_rank: int
    cp_rank: int = 0


@dataclass(frozen=True)
class Layout:
    """The rank grid for ``world_size`` processes split into TP x CP x DP x PP.

    Attributes:
        world_size: total number of processes.
        tp_size: tensor-parallel degree (ranks that split each layer's weights).
        pp_size: pipeline-parallel degree (ranks that split the stack of layers).
        cp_size: context-parallel degree (ranks that split each sequence; they hold the same weights).
        ep_size: expert-parallel degree (replica ranks that split each MoE layer's experts between them).
        etp_size: the experts' tensor-parallel degree: ``tp_size`` (each expert split over the TP group; given as
            ``None``, it is set to ``tp_size``) or 1 (every expert whole on each TP rank). It changes no group.
    """

    world_size: int
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    etp_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("world_size", "tp_size", "pp_size", "cp_size", "ep_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        if self.etp_size is None:
            object.__setattr__(self, "etp_size", self.tp_size)  # (frozen) one spelling of the default
        if type(self.etp_size) is not int or self.etp_size not in (1, self.tp_size):
            raise LayoutError(
                f"the experts' TP size {self.etp_size!r} is neither the TP size ({self.tp_size}) nor 1 (each expert "
                "split over the TP group, or whole on every TP rank)"
            )
        cut = self.tp_size * self.cp_size * self.pp_size
        if self.world_size % cut:
            valid = [n for n in range(1, self.world_size + 1) if self.world_size % n == 0]
            names = "tp*cp*pp" if self.cp_size > 1 else "tp*pp"
            sizes = (
                f"{self.tp_size}*{self.cp_size}*{self.pp_size}"
                if self.cp_size > 1
                else f"{self.tp_size}*{self.pp_size}"
            )
            raise LayoutError(
                f"world size {self.world_size} is not divisible by {names} = {sizes} = "
                f"{cut}; {names} must divide the world size (divisors of {self.world_size}: {valid})"
            )
        if self.replica_size % self.ep_size:
            valid = [n for n in range(1, self.replica_size + 1) if self.replica_size % n == 0]
            raise LayoutError(
                f"expert parallelism {self.ep_size} does not divide the {self.replica_size} ranks that hold the same "
                f"dense weights (dp x cp = {self.dp_size} x {self.cp_size}); EP is carved out of them: use one of "
                f"{valid}"
            )

    @property
    def dp_size(self) -> int:
        """Number of data shards (data-parallel degree)."""
        return self.world_size // (self.tp_size * self.cp_size * self.pp_size)

    @property
    def replica_size(self) -> int:
        """Ranks holding the same weights: DP x CP (gradients are reduced over them)."""
        return self.dp_size * self.cp_size

    def coords(self, rank: int) -> Coords:
        """(tp_rank, dp_rank, pp_rank, cp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside the world of {self.world_size} processes")
        tp_rank = rank % self.tp_size
        cp_rank = (rank // self.tp_size) % self.cp_size
        dp_rank = (rank // (self.tp_size * self.cp_size)) % self.dp_size
        pp_rank = rank // (self.tp_size * self.cp_size * self.dp_size)
        return Coords(tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=pp_rank, cp_rank=cp_rank)

    def rank_at(self, tp_rank: int, dp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        """Global rank at the given coordinates (inverse of :meth:`coords`)."""
        return ((pp_rank * self.dp_size + dp_rank) * self.cp_size + cp_rank) * self.tp_size + tp_rank

    def _slices(self, spans: str) -> list[list[int]]:
        """Every group that varies the axes named in ``spans`` (of ``p``, ``d``, ``c``, ``t``) and fixes the others;
        groups and the ranks inside them both ordered pp, dp, cp, tp (outermost first)."""
        sizes = {"p": self.pp_size, "d": self.dp_size, "c": self.cp_size, "t": self.tp_size}
        fixed_axes = [axis for axis in "pdct" if axis not in spans]
        span_axes = [axis for axis in "pdct" if axis in spans]
        groups = []
        for fixed in itertools.product(*(range(sizes[axis]) for axis in fixed_axes)):
            group = []
            for varying in itertools.product(*(range(sizes[axis]) for axis in span_axes)):
                at = dict(zip(fixed_axes, fixed)) | dict(zip(span_axes, varying))
                group.append(self.rank_at(at["t"], at["d"], at["p"], at["c"]))
            groups.append(group)
        return groups

    # Each kind of group fixes all coordinates but the ones it spans.
    def tp_groups(self) -> list[list[int]]:
        return self._slices("t")

    def cp_groups(self) -> list[list[int]]:
        return self._slices("c")

    def dp_groups(self) -> list[list[int]]:
        return self._slices("d")

    def replica_groups(self) -> list[list[int]]:
        """DP x CP groups: every rank holding the same shard of the weights (gradients and optimizer state)."""
        return self._slices("dc")

    def pp_groups(self) -> list[list[int]]:
        return self._slices("p")

    def ep_groups(self) -> list[list[int]]:
        """Runs of ``ep`` consecutive ranks of each replica group: they hold different experts."""
        return [
            group[i : i + self.ep_size] for group in self.replica_groups() for i in range(0, len(group), self.ep_size)
        ]

    def expert_replica_groups(self) -> list[list[int]]:
        """The ranks at the same place in each replica group's EP runs: they hold the same experts (Megatron's
        expert-data-parallel group), so the experts' gradients are reduced over them."""
        return [group[i :: self.ep_size] for group in self.replica_groups() for i in range(self.ep_size)]

    def model_parallel_groups(self) -> list[list[int]]:
        """TP x PP groups: every rank that holds a piece of one model replica."""
        return self._slices("pt")

    def batch_groups(self) -> list[list[int]]:
        """TP x CP x PP groups: every rank that computes on one batch (a replica's model-parallel ranks and the
        ranks that split its sequences)."""
        return self._slices("pct")

    def embedding_groups(self) -> list[list[int]]:
        """First and last stage of each pipeline: they hold the tied input/output embeddings."""
        return [sorted({group[0], group[-1]}) for group in self.pp_groups()]

    def groups(self, kind: str) -> list[list[int]]:
        """All groups of one kind: ``tp``, ``cp``, ``dp``, ``replica`` (DP x CP), ``pp``, ``ep``, ``expert_replica``,
        ``mp`` (model-parallel), ``batch`` (TP x CP x PP) or ``embedding``."""
        builders = {
            "tp": self.tp_groups,
            "cp": self.cp_groups,
            "dp": self.dp_groups,
            "replica": self.replica_groups,
            "pp": self.pp_groups,
            "ep": self.ep_groups,
            "expert_replica": self.expert_replica_groups,
            "mp": self.model_parallel_groups,
            "batch": self.batch_groups,
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
