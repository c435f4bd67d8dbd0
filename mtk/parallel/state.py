"""The topology of a running job: the rank layout, this rank's coordinates and its process groups.

One :class:`ParallelState` is built per process and passed explicitly to whatever needs a group
(layers take their group in the constructor; nothing looks groups up from module globals). It also
implements the Megatron ``mpu`` protocol DeepSpeed expects, so ``deepspeed.initialize(mpu=state)``
makes ZeRO partition over the data-parallel group only.

Backends are never hard-coded: the default process group is created with torch's per-device default
(gloo for CPU tensors, NCCL for CUDA tensors), and sub-groups inherit it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from mtk.config import ParallelConfig, check_expert_tp_size
from mtk.errors import process_group_start
from mtk.parallel.layout import Layout, LayoutError

__all__ = ["ParallelState", "default_device", "group_timeout", "groups_made", "init_distributed", "new_group"]

_KINDS = ("tp", "dp", "pp", "mp", "embedding")
_CONTEXT_KINDS = ("cp", "replica", "batch")  # created only at cp > 1 (at cp = 1: the DP group, the mp group)
_EXPERT_KINDS = ("ep", "expert_replica")  # created only at ep > 1 (at ep = 1 the experts' replicas are the replicas)

# Every group this process created, kept until the process ends. DDP's C++ Reducer owns its group and is freed
# without releasing the GIL; were it the group's last owner (accelerate's ``end_training`` has already destroyed the
# groups), the group's destructor would join its gloo threads while holding the GIL, and a thread still finishing the
# last collective needs the GIL to free it: the script hangs as its ``main`` returns (pytorch#56297; seen about once
# in seven 2-process runs of plain accelerate). Keeping a Python owner makes the Reducer never the last.
_CREATED: list[dist.ProcessGroup] = []


def groups_made() -> bool:
    """Whether this process made a process group (its threads live until the process ends)."""
    return bool(_CREATED) or (dist.is_available() and dist.is_initialized())


def new_group(ranks: list[int], device: torch.device) -> dist.ProcessGroup:
    """``dist.new_group`` (collective over the world) with the world group's timeout, kept for the process."""
    group = dist.new_group(ranks=ranks, timeout=group_timeout(device=device))
    _CREATED.append(group)
    return group


def default_device(local_rank: int = 0) -> torch.device:
    """This process's accelerator (``cuda:<local_rank>``, ...) when one exists, else the CPU."""
    # (check_available: a CUDA build on a machine without a GPU runs on the CPU)
    accelerator = (
        torch.accelerator.current_accelerator(check_available=True) if hasattr(torch, "accelerator") else None
    )
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, local_rank % max(torch.accelerator.device_count(), 1))


def group_timeout(group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> timedelta | None:
    """How long a collective of ``group`` (default: the world) waits for its peers before it fails.

    ``None`` without a process group or for a backend that does not say.
    """
    if not dist.is_initialized():
        return None
    group = dist.group.WORLD if group is None else group
    device = default_device() if device is None else device
    try:
        return group._get_backend(torch.device(device.type)).options._timeout  # type: ignore[union-attr]
    except (AttributeError, RuntimeError):
        return None


def init_distributed(env: Mapping[str, str] | None = None, timeout: timedelta | None = None) -> None:
    """Create the default process group from the launcher's environment (torchrun, accelerate, deepspeed).

    Does nothing when a group already exists or when the job is a single process without launcher
    variables. The backends are torch's per-device defaults, so the same call works on CPU (gloo) and
    CUDA (NCCL for CUDA tensors, gloo for CPU ones). ``timeout``: how long a collective waits for a peer
    that hung or died before it fails (torch's default when ``None``).
    """
    env = os.environ if env is None else env
    if dist.is_initialized():
        return
    world_size = int(env.get("WORLD_SIZE", "1"))
    if world_size == 1 and "MASTER_ADDR" not in env:
        return
    device = default_device(int(env.get("LOCAL_RANK", "0")))
    if device.type == "cpu":
        with process_group_start():
            dist.init_process_group(timeout=timeout)
        return
    torch.accelerator.set_device_index(device.index)
    # bound to its device: NCCL then need not guess the rank-to-GPU mapping (a hang where it guesses wrong); a
    # device without a backend named would get the device's backend alone, so CPU tensors keep gloo
    backend = f"cpu:gloo,{device.type}:{dist.Backend.default_device_backend_map[device.type]}"
    with process_group_start():
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device)


class ParallelState:
    """Rank layout + process groups of one process. Build it with :meth:`build` or :meth:`from_env`.

    Vocabulary, used everywhere in mtk: ``tp_rank``/``tp_size``/``tp_group`` and the same for ``cp``,
    ``dp`` and ``pp``; ``replica`` is the DP x CP group (ranks with the same weights: gradients, optimizer
    state and metrics are reduced over it; data is split over ``dp`` only); ``ep`` spreads each MoE layer's experts
    over runs of replica ranks and ``expert_replica`` holds the same experts (their gradients are reduced over
    it); ``mp`` is the model-parallel
    (TP x PP) group; the embedding group joins the first and last pipeline stages (``None`` on ranks
    outside it).
    """

    def __init__(
        self,
        layout: Layout,
        rank: int,
        groups: Mapping[str, dist.ProcessGroup | None],
        device: torch.device,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.device = device
        coords = layout.coords(rank)
        self.tp_rank, self.dp_rank, self.pp_rank = coords.tp_rank, coords.dp_rank, coords.pp_rank
        self.cp_rank = coords.cp_rank
        self.tp_ranks = layout.group_of("tp", rank)
        self.cp_ranks = layout.group_of("cp", rank)
        self.dp_ranks = layout.group_of("dp", rank)
        self.replica_ranks = layout.group_of("replica", rank)
        self.pp_ranks = layout.group_of("pp", rank)
        self.mp_ranks = layout.group_of("mp", rank)
        self.batch_ranks = layout.group_of("batch", rank)
        self.embedding_ranks = layout.group_of("embedding", rank)
        self.tp_group = groups.get("tp")
        self.dp_group = groups.get("dp")
        self.cp_group = groups.get("cp")
        self.replica_group = groups.get("replica") if layout.cp_size > 1 else self.dp_group
        self.ep_ranks = layout.group_of("ep", rank)
        self.expert_replica_ranks = layout.group_of("expert_replica", rank)
        self.ep_group = groups.get("ep")
        self.expert_replica_group = groups.get("expert_replica") if layout.ep_size > 1 else self.replica_group
        self.pp_group = groups.get("pp")
        self.mp_group = groups.get("mp")
        self.batch_group = groups.get("batch") if layout.cp_size > 1 else self.mp_group
        self.embedding_group = groups.get("embedding")

    # ----------------------------------------------------------------------------------- building
    @classmethod
    def build(
        cls,
        tp_size: int = 1,
        pp_size: int = 1,
        *,
        cp_size: int = 1,
        ep_size: int = 1,
        etp_size: int | None = None,
        device: torch.device | None = None,
    ) -> ParallelState:
        """Create every TP/CP/DP/replica/PP/MP/embedding group. Collective: all ranks must call it together.

        Without an initialized process group the job must be a single process; the groups are then
        ``None`` and every collective in mtk is skipped. Every group waits as long as the world group
        does (``dist.new_group`` would otherwise take torch's default, ignoring the timeout the job set).
        """
        if dist.is_initialized():
            world_size, rank = dist.get_world_size(), dist.get_rank()
        else:
            world_size, rank = 1, 0
        check_expert_tp_size(etp_size, tp_size)
        layout = Layout(world_size, tp_size, pp_size, cp_size, ep_size, etp_size)
        if device is None:
            device = default_device(int(os.environ.get("LOCAL_RANK", "0")))
        kinds = _KINDS + (_CONTEXT_KINDS if cp_size > 1 else ()) + (_EXPERT_KINDS if ep_size > 1 else ())
        groups: dict[str, dist.ProcessGroup | None] = dict.fromkeys(kinds)
        if dist.is_initialized():
            # dist.new_group is collective over the whole world: every rank creates every group, in
            # the same order, and keeps the one it belongs to.
            for kind in kinds:
                for ranks in layout.groups(kind):
                    group = new_group(ranks, device)
                    if rank in ranks:
                        groups[kind] = group
        return cls(layout, rank, groups, device)

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, timeout: timedelta | None = None, **explicit
    ) -> ParallelState:
        """Initialize torch.distributed from the launcher's variables and build the groups.

        TP/PP/CP sizes: explicit ``tp_size``/``pp_size``/``cp_size`` if given, else the ``MEGATRON_LM_*``
        variables ``accelerate launch`` exports for a ``megatron_lm_config`` block (:class:`ParallelConfig`).
        ``timeout``: see :func:`init_distributed`.
        """
        init_distributed(env, timeout)
        config = ParallelConfig.from_env(env, **explicit)
        return cls.build(
            config.tp_size, config.pp_size, cp_size=config.cp_size, ep_size=config.ep_size, etp_size=config.etp_size
        )

    @property
    def config(self) -> ParallelConfig:
        """The topology this state was built for."""
        return ParallelConfig(tp_size=self.tp_size, pp_size=self.pp_size, cp_size=self.cp_size)

    def tp_subgroup(self, size: int) -> dist.ProcessGroup | None:
        """This rank's block of ``size`` consecutive ranks inside its TP group (created once, cached).

        Used for kv heads replicated over ``tp / n_kv`` ranks. Collective on first use: every rank
        creates the blocks of every TP group, in the same order.
        """
        if size < 1 or self.tp_size % size:
            raise LayoutError(f"a TP sub-group of {size} ranks does not divide tp = {self.tp_size}")
        cache = self.__dict__.setdefault("_tp_subgroups", {})
        if size not in cache:
            mine = None
            if dist.is_initialized() and size > 1:
                for tp_ranks in self.layout.tp_groups():
                    for start in range(0, self.tp_size, size):
                        block = tp_ranks[start : start + size]
                        group = new_group(block, self.device)
                        if self.rank in block:
                            mine = group
            cache[size] = mine
        return cache[size]

    # ---------------------------------------------------------------------------------- pickling
    def __getstate__(self) -> dict:
        """Process groups travel by their registered names (``pickle``/``deepcopy`` of an Accelerator).

        A group is a handle into this job's communicator, so the copy resolves the same groups again
        when it is unpickled inside the same job; anywhere else it fails with one clear line.
        """
        state = dict(self.__dict__)
        for key in [k for k, v in state.items() if isinstance(v, dist.ProcessGroup)]:
            state[key] = _GroupName(state[key].group_name)
        if "_tp_subgroups" in state:
            state["_tp_subgroups"] = {
                size: _GroupName(g.group_name) if g is not None else None for size, g in state["_tp_subgroups"].items()
            }
        return state

    def __setstate__(self, state: dict) -> None:
        state = {k: _GroupName.resolve(v) for k, v in state.items()}
        if "_tp_subgroups" in state:
            state["_tp_subgroups"] = {size: _GroupName.resolve(g) for size, g in state["_tp_subgroups"].items()}
        self.__dict__.update(state)

    def destroy(self) -> None:
        """Release the sub-groups this state created (the default group is left to its owner)."""
        if not dist.is_initialized():
            return
        owned = (
            self.tp_group,
            self.cp_group,
            self.dp_group,
            self.replica_group,
            self.ep_group,
            self.expert_replica_group,
            self.pp_group,
            self.mp_group,
        )
        for group in {id(g): g for g in owned if g}.values():
            dist.destroy_process_group(group)

    # ---------------------------------------------------------------------------------- shortcuts
    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def pp_size(self) -> int:
        return self.layout.pp_size

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    @property
    def cp_size(self) -> int:
        return self.layout.cp_size

    @property
    def replica_size(self) -> int:
        return self.layout.replica_size

    @property
    def ep_size(self) -> int:
        return self.layout.ep_size

    @property
    def etp_size(self) -> int:
        """The experts' TP size: the TP size (each expert split as the dense MLPs are) or 1 (whole on every TP
        rank, each running them on its share of the tokens: :mod:`mtk.parallel.expert_tokens`)."""
        return int(self.layout.etp_size or self.tp_size)  # (set by Layout: never None)

    @property
    def ep_rank(self) -> int:
        """This rank's index in its EP group: which run of each MoE layer's experts it holds."""
        return self.ep_ranks.index(self.rank)

    @property
    def replica_rank(self) -> int:
        """This rank's index among the ranks holding its weights (0: the one that writes them)."""
        return self.replica_ranks.index(self.rank)

    @property
    def batch_src_rank(self) -> int:
        """Global rank of the batch group's source (TP rank 0, CP rank 0 of the first stage): what the other ranks
        computing on this replica's batch take it and their replicated-region RNG from
        (:mod:`mtk.parallel.consistency`)."""
        return self.batch_ranks[0]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def validate_divisible(self, what: str, value: int) -> None:
        """Raise a one-line error when ``value`` (heads, vocab, ...) cannot be split ``tp_size`` ways."""
        if value % self.tp_size:
            valid = [n for n in range(1, value + 1) if value % n == 0]
            raise LayoutError(
                f"{what} = {value} is not divisible by tp = {self.tp_size}; valid tp sizes for this model: {valid}"
            )

    def __repr__(self) -> str:
        return (
            f"ParallelState(rank={self.rank}, world={self.world_size}, tp={self.tp_rank}/{self.tp_size}, "
            f"cp={self.cp_rank}/{self.cp_size}, dp={self.dp_rank}/{self.dp_size}, pp={self.pp_rank}/{self.pp_size}, "
            f"ep={self.ep_rank}/{self.ep_size}, device={self.device})"
        )

    # ------------------------------------------------- Megatron ``mpu`` protocol, used by DeepSpeed
    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup | None:
        return self.tp_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group (the source of TP broadcasts)."""
        return self.tp_ranks[0]

    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup | None:
        return self.pp_group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pp_size

    # DeepSpeed's pipeline grid spells these "pipe".
    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size

    def get_context_parallel_group(self) -> dist.ProcessGroup | None:
        return self.cp_group

    def get_context_parallel_rank(self) -> int:
        return self.cp_rank

    def get_context_parallel_world_size(self) -> int:
        return self.cp_size

    # DeepSpeed's sequence parallelism is mtk's CP: ZeRO partitions and reduces over the sequence-data-parallel
    # (DP x CP) group, divides the gradients by DP only, and counts the batch over DP.
    get_sequence_parallel_group = get_context_parallel_group
    get_sequence_parallel_rank = get_context_parallel_rank
    get_sequence_parallel_world_size = get_context_parallel_world_size

    def get_sequence_data_parallel_group(self) -> dist.ProcessGroup | None:
        return self.replica_group

    def get_sequence_data_parallel_rank(self) -> int:
        return self.replica_rank

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.replica_size

    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        return self.dp_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_ranks)

    def get_model_parallel_group(self) -> dist.ProcessGroup | None:
        """TP x PP group: DeepSpeed reduces overflow flags and grad norms of sharded params over it."""
        return self.mp_group

    def get_model_parallel_rank(self) -> int:
        return self.mp_ranks.index(self.rank)

    def get_model_parallel_world_size(self) -> int:
        return self.tp_size * self.pp_size

    def get_embedding_group(self) -> dist.ProcessGroup | None:
        return self.embedding_group


class _GroupName(str):
    """A pickled reference to a process group of this job, by the name torch registered it under."""

    @staticmethod
    def resolve(value):
        if not isinstance(value, _GroupName):
            return value
        try:
            return c10d._resolve_process_group(str(value))
        except (RuntimeError, ValueError, AttributeError):
            raise LayoutError(
                f"process group {str(value)!r} does not exist in this process; a ParallelState (or an Accelerator "
                "holding one) can only be unpickled inside the job that created it"
            ) from None
