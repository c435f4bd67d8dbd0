"""What the planner is asked (:class:`Request`), what it weighs (:class:`Candidate`: one layout and its training
options) and what it answers for each (:class:`Estimate`, as ``mtk plan --json`` prints it). The search over
them is :mod:`mtk.planner.search`."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PretrainedConfig

from mtk.planner.cluster import Cluster
from mtk.planner.memory import RankMemory
from mtk.planner.timing import StepTime, Traffic

__all__ = ["Candidate", "Estimate", "Request"]


@dataclass(frozen=True)
class Request:
    """What to plan for."""

    config: PretrainedConfig
    cluster: Cluster
    seq: int
    global_batch: int
    dtype: str = "bf16"
    lora_r: int = 0
    lora_target_parameters: tuple[str, ...] = ()  # with lora_r: tensors adapted too (PEFT's target_parameters)
    engines: tuple[str, ...] = ("accelerate", "deepspeed")
    offload: bool = False
    reserve: int = 2 * 2**30  # per GPU: CUDA context, communicator buffers, allocator slack
    tp_size: int | None = None
    pp_size: int | None = None
    cp_sizes: tuple[int, ...] = (1,)  # context-parallel degrees to weigh (mtk plan --cp)
    cp_comm: str = "p2p"  # context-parallel attention: ring (p2p) or all-to-all (a2a)
    ep_sizes: tuple[int, ...] = (1,)  # expert-parallel degrees to weigh on an MoE model (mtk plan --ep)
    # the experts' TP sizes to weigh on an MoE model at TP > 1 (mtk plan --etp): None (the TP size), 1 (whole)
    etp_sizes: tuple[int | None, ...] = (None,)
    device: str = "cuda"  # attention kernels of this device (``cpu`` for the validation on this machine)
    ddp: bool = True  # accelerate at pp = 1 reduces through DDP's buckets (False: one coalesced all-reduce)
    every_setting: bool = False


@dataclass(frozen=True)
class Candidate:
    """One layout and its training options."""

    tp_size: int
    pp_size: int
    dp_size: int
    micro_batch_size: int
    micro_batches: int  # per optimizer step: pipeline micro-batches, or gradient accumulation at pp = 1
    sequence_parallel: bool = False
    recompute: str | None = None
    engine: str = "accelerate"
    sharding: str = "none"
    offload: bool = False
    virtual_stages: int = 1  # > 1: the interleaved schedule over this many model chunks per pipeline rank
    pipeline_layers: tuple[int, ...] = ()  # decoder layers per stage (chunk) as given; (): mtk's default split
    cp_size: int = 1  # ranks that split each sequence (they hold the same weights: DP x CP replicas)
    ep_size: int = 1  # replicas each MoE layer's experts are spread over (carved out of DP)
    etp_size: int | None = None  # the experts' TP size: None (the TP size) or 1 (whole, each TP rank its tokens)

    @property
    def replica_size(self) -> int:
        """Ranks holding the same weights: gradients are reduced and optimizer state is sharded over DP x CP."""
        return self.dp_size * self.cp_size

    @property
    def label(self) -> str:
        parts = [
            f"tp{self.tp_size}{f' cp{self.cp_size}' if self.cp_size > 1 else ''} pp{self.pp_size} dp{self.dp_size}"
            + (f" ep{self.ep_size}" if self.ep_size > 1 else "")
            + (" etp1" if self.etp_size == 1 else ""),
            f"{self.micro_batch_size}x{self.micro_batches}",
        ]
        if self.virtual_stages > 1:
            parts.append(f"v{self.virtual_stages}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.recompute:
            parts.append(f"recompute={self.recompute}")
        if self.sharding != "none":
            parts.append(self.sharding + ("+offload" if self.offload else ""))
        return " ".join(parts)


@dataclass(frozen=True)
class Estimate:
    """A candidate's predicted memory (its fullest rank), traffic and step time."""

    candidate: Candidate
    memory: RankMemory
    stage: int  # the pipeline stage of the fullest rank
    traffic: Traffic
    time: StepTime
    fits: bool
    tokens_per_s: float
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)  # the fullest rank's, by kind
    stages: tuple[RankMemory, ...] = ()  # every pipeline stage's TP rank

    def as_dict(self) -> dict:
        c = self.candidate
        return {
            "layout": {
                "tp_size": c.tp_size,
                "pp_size": c.pp_size,
                "dp_size": c.dp_size,
                "cp_size": c.cp_size,
                "ep_size": c.ep_size,
                "etp_size": c.etp_size or c.tp_size,
                "micro_batch_size": c.micro_batch_size,
                "micro_batches": c.micro_batches,
                "virtual_stages": c.virtual_stages,
                "sequence_parallel": c.sequence_parallel,
                "recompute": c.recompute,
                "engine": c.engine,
                "sharding": c.sharding,
                "offload": c.offload,
            },
            "label": c.label,
            "fits": self.fits,
            "memory_bytes": self.memory.as_dict(),
            "fullest_stage": self.stage,
            "memory_bytes_per_stage": [m.as_dict() for m in self.stages],
            "communication_bytes": {
                "tp": self.traffic.tp_bytes,
                "cp": self.traffic.cp_bytes,
                "ep": self.traffic.ep_bytes,
                "pp": self.traffic.pp_bytes,
                "dp": self.traffic.dp_bytes,
            },
            "collectives": self.collectives,
            "step_s": self.time.as_dict(),
            "tokens_per_s": self.tokens_per_s,
        }
