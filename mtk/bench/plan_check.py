"""Hold ``mtk plan``'s memory against a measured run: the same layout, model and batch as ``mtk bench``.

``mtk bench --memory`` and ``tests/distributed/test_plan_check.py`` run the bench's mtk contender with the
live-byte counter on (max allocated on CUDA) and compare, per rank, the measured peak with the planner's
prediction for that rank's pipeline stage, and the model state (weights, gradients, AdamW moments counted on
the live objects) with the predicted one, which must be exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtk.bench.contenders import BenchSpec
from mtk.bench.runner import ContenderSummary
from mtk.errors import ConfigError
from mtk.models import resolve_config
from mtk.planner.cluster import Cluster
from mtk.planner.memory import RankMemory
from mtk.planner.search import Candidate, Estimate, Request, estimate, rank_memory, stage_collectives

# Layouts the planner is checked on (tests/distributed/test_plan_check.py, examples/benchmarks/plan_check.py): TP,
# SP with full recompute, selective recompute, TP x DP with the distributed optimizer, TP x PP in a 1F1B steady
# state, a pipeline that never leaves its warm-up, a model whose attention dropout takes torch's math path on CPU,
# and context parallelism (its score blocks and its traffic), ring and all-to-all.
CHECKED_LAYOUTS: dict[str, dict] = {
    "tp2": dict(model="bench-llama", tp_size=2, pp_size=1, batch=2, seq=256),
    "tp2 sp recompute=full": dict(
        model="bench-llama", tp_size=2, pp_size=1, batch=2, seq=256, sequence_parallel=True, recompute="full"
    ),
    "tp2 recompute=selective": dict(
        model="bench-llama", tp_size=2, pp_size=1, batch=2, seq=256, recompute="selective"
    ),
    "tp2 dp2 distopt": dict(
        model="bench-llama", tp_size=2, pp_size=1, dp_size=2, batch=2, seq=256, distributed_optimizer=True
    ),
    "tp2 pp2 m=4 (1F1B steady)": dict(model="bench-llama", tp_size=2, pp_size=2, batch=4, seq=256, micro_batches=4),
    "pp2 m=2 (warm-up only)": dict(model="bench-llama", tp_size=1, pp_size=2, batch=2, seq=256, micro_batches=2),
    "tiny-gpt2 tp2 (dropout)": dict(model="tiny-gpt2", tp_size=2, pp_size=1, batch=4, seq=128),
    "cp2 (ring)": dict(model="bench-llama", tp_size=1, pp_size=1, cp_size=2, batch=1, seq=1024),
    "moe tp2 etp1 (whole experts)": dict(model="bench-qwen3-moe", tp_size=2, pp_size=1, batch=2, seq=256, etp_size=1),
    "tp2 cp2 sp (all-to-all)": dict(
        model="bench-llama", tp_size=2, pp_size=1, cp_size=2, cp_comm="a2a", batch=1, seq=1024, sequence_parallel=True
    ),
}

__all__ = ["CHECKED_LAYOUTS", "RankCheck", "check_lines", "check_ranks", "planned_collectives", "planned_for"]


def planned_for(spec: BenchSpec, device: str) -> Estimate:
    """The planner's estimate of the bench's layout (each DP replica runs ``spec.batch`` sequences; the
    bench reduces gradients in one coalesced all-reduce, not through DDP)."""
    return estimate(*_request_and_candidate(spec, device))


def planned_collectives(spec: BenchSpec, device: str, stage: int = 0) -> dict[str, dict[str, int]]:
    """What the planner says a TP rank of ``stage`` issues per step (the bench counts rank 0's)."""
    return stage_collectives(*_request_and_candidate(spec, device), stage)


def _request_and_candidate(spec: BenchSpec, device: str) -> tuple[Request, Candidate]:
    if spec.dtype != "fp32":
        raise ConfigError(
            "--memory compares with mtk plan, whose bf16 is mixed precision (fp32 weights); the bench's "
            f"--dtype {spec.dtype} is pure {spec.dtype}: use --dtype fp32"
        )
    world = spec.tp_size * spec.cp_size * spec.pp_size * spec.dp_size
    request = Request(
        config=resolve_config(spec.model),
        cluster=Cluster(gpus=world, gpu_memory=2**50),
        seq=spec.seq,
        global_batch=spec.batch * spec.dp_size,
        dtype="fp32",
        engines=("accelerate",),
        reserve=0,
        device=device,
        ddp=False,
        cp_sizes=(spec.cp_size,),
        cp_comm=spec.cp_comm,
        ep_sizes=(spec.ep_size,),
        etp_sizes=(spec.etp_size,),
    )
    candidate = Candidate(
        tp_size=spec.tp_size,
        pp_size=spec.pp_size,
        dp_size=spec.dp_size,
        micro_batch_size=spec.batch // spec.micro_batches,
        micro_batches=spec.micro_batches,
        virtual_stages=spec.virtual_stages,
        pipeline_layers=spec.pipeline_layers,
        sequence_parallel=spec.sequence_parallel,
        recompute=spec.recompute,
        sharding="distopt" if spec.distributed_optimizer else "fsdp2" if spec.fsdp else "none",
        cp_size=spec.cp_size,
        ep_size=spec.ep_size,
        etp_size=spec.etp_size,
    )
    return request, candidate


@dataclass(frozen=True)
class RankCheck:
    """One rank: what the planner predicted for its stage and what the run measured."""

    rank: int
    stage: int
    predicted: RankMemory
    measured_peak: int  # live bytes at the step's peak (max allocated on CUDA)
    measured_state: dict[str, int]  # weights, gradients, optimizer

    @property
    def ratio(self) -> float:
        return self.predicted.peak / self.measured_peak

    @property
    def state_exact(self) -> bool:
        want = {"weights": self.predicted.weights, "gradients": self.predicted.gradients}
        want["optimizer"] = self.predicted.optimizer
        return want == self.measured_state


def check_ranks(spec: BenchSpec, summary: ContenderSummary, device: str) -> list[RankCheck]:
    """Per rank of a ``track_memory`` run: predicted vs measured peak and model state."""
    request, candidate = _request_and_candidate(spec, device)
    checks = []
    for rank, (kinds, state) in enumerate(zip(summary.memory_by_kind, summary.model_state)):
        stage, replica_rank = divmod(rank // spec.tp_size, spec.dp_size * spec.cp_size)  # TP, CP, DP, then PP
        predicted = rank_memory(request, candidate, stage, replica_rank)
        measured = kinds.get("max_allocated") or kinds.get("live_peak") or kinds["total"]
        checks.append(RankCheck(rank, stage, predicted, measured, dict(state)))
    return checks


def check_lines(checks: list[RankCheck]) -> list[str]:
    """``rank 0 (stage 0): measured 255.8 MiB, planned 262.0 MiB (1.02x); model state exact``."""
    lines = []
    for c in checks:
        state = "model state exact" if c.state_exact else f"model state DIFFERS: measured {c.measured_state}"
        lines.append(
            f"  rank {c.rank} (stage {c.stage}): measured {c.measured_peak / 2**20:.1f} MiB, "
            f"planned {c.predicted.peak / 2**20:.1f} MiB ({c.ratio:.2f}x); {state}"
        )
    return lines
