"""What every contender shares: the spec of a bench run, one rank's result, and how a step is timed, its
collectives counted and its memory measured.

Every contender builds the model from the same seed (same weights), draws the same batch, takes
``warmup`` untimed steps, then ``steps`` timed ones, each started together on all ranks (barrier)
and timed on each rank; the step time of a layout is its slowest rank's.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from mtk.parallel.collective_count import count_collectives
from mtk.parallel.distributed_optimizer import shard_optimizer
from mtk.parallel.fsdp import local
from mtk.parallel.state import default_device
from mtk.planner.live_memory import LiveMemory

__all__ = [
    "BenchSpec",
    "RankResult",
    "bench_batch",
    "bench_device",
    "count_model_state",
    "live_peaks",
    "measure_model",
    "measure_step",
    "resident_memory",
    "synchronize",
    "track_memory_by_kind",
    "train_step",
]


@dataclass(frozen=True)
class BenchSpec:
    """What every contender runs: the model, the layout and the batch."""

    model: str
    tp_size: int
    pp_size: int
    batch: int
    seq: int
    steps: int
    warmup: int = 1
    dtype: str = "fp32"
    micro_batches: int = 1
    seed: int = 0
    threads: int = 1  # threads per process (the plain-HF baseline also runs with all cores)
    sequence_parallel: bool = False  # mtk only: Megatron's sequence parallelism
    recompute: str | None = None  # mtk only: "full" or "selective" activation recomputation
    track_memory: bool = False  # mtk only: one more step under torch's MemTracker (memory by kind)
    dp_size: int = 1  # mtk only: data-parallel replicas (each the same batch); gradients averaged over them
    distributed_optimizer: bool = False  # mtk only: AdamW state sharded over the DP group
    fsdp: bool = False  # mtk only: FSDP2 over the DP group (weights, gradients and AdamW state sharded)
    checkpoint_dir: str | None = None  # the same weights as a local HF directory (for from_pretrained)
    pipeline_layers: tuple[int, ...] = ()  # mtk only, pp > 1: decoder layers per stage (chunk) (default: mtk's)
    pipeline_schedule: str = "1f1b"  # mtk only, pp > 1: afab, 1f1b or interleaved
    virtual_stages: int = 1  # mtk only, interleaved: model chunks per pipeline rank
    loss_chunk_tokens: int | None = None  # mtk only: the chunked loss's tokens per chunk (None: sized; 0: off)
    cp_size: int = 1  # mtk only: context parallelism, the sequence split over this many ranks per TP rank
    cp_comm: str = "p2p"  # mtk only, cp > 1: ring ("p2p") or all-to-all ("a2a") attention
    ep_size: int = 1  # mtk only: expert parallelism, each MoE layer's experts spread over this many DP replicas
    etp_size: int | None = None  # mtk only: the experts' TP size (None: the TP size; 1: whole, the tokens split)


@dataclass
class RankResult:
    """One rank's measurements."""

    step_s: list[float]
    peak_memory: int  # bytes: max RSS on CPU, max allocated on CUDA
    loss: float
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)  # kind -> {"count", "bytes"}
    memory_above_start: int = 0  # bytes: the peak above what the process held before the model was built
    memory_by_kind: dict[str, int] = field(default_factory=dict)  # bytes at the peak: param, grad, act, opt, ...
    model_state: dict[str, int] = field(default_factory=dict)  # bytes: weights, gradients, optimizer (AdamW moments)
    pipeline_busy_s: float | None = None  # pp > 1: the timed schedules' seconds not blocked on a neighbour
    pipeline_schedule_s: float | None = None  # pp > 1: the timed schedules' seconds on this rank
    reduction_s: float | None = None  # dp > 1: one DP all-reduce of this rank's gradients, ranks started together
    activation_all_reduce_s: float | None = None  # tp > 1: one TP all-reduce of a [b, s, h] activation (median)

    def as_dict(self) -> dict:
        return asdict(self)


def bench_batch(spec: BenchSpec, vocab: int, device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(spec.seed + 1)
    return torch.randint(0, vocab, (spec.batch, spec.seq), generator=generator).to(device)  # [b, s]


def resident_memory(device: torch.device) -> int:
    """Bytes held now: allocated on an accelerator, the resident set on CPU (0 where /proc is missing)."""
    if device.type != "cpu":
        return torch.get_device_module(device.type).memory_allocated(device)
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def measure_step(
    spec: BenchSpec,
    step: Callable[[], torch.Tensor],
    device: torch.device,
    baseline: int = 0,
    count_calls: bool = True,
) -> RankResult:
    """Warm up, count the collectives of one step, then time ``spec.steps`` steps. ``count_calls=False`` for a peer
    whose library checks torch's P2P entry points by identity (the counter wraps them)."""
    for _ in range(spec.warmup):
        step()
    with count_collectives() if count_calls else contextlib.nullcontext() as log:
        loss = step()
    synchronize(device)
    times = []
    for _ in range(spec.steps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        loss = step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    collectives = {}
    if log is not None:
        nbytes = log.bytes_by_kind()
        collectives = {k: {"count": n, "bytes": nbytes[k]} for k, n in log.counts().items() if k != "barrier"}
    peak = _peak_memory(device)
    return RankResult(times, peak, float(loss), collectives, max(peak - baseline, 0) if baseline else 0)


def track_memory_by_kind(model, optimizer, step: Callable[[], torch.Tensor]) -> dict[str, int]:
    """Live bytes by kind at the peak of one step (torch's MemTracker: parameters, gradients, activations,
    optimizer state, temporaries), exact on any device where the RSS of a CPU process is not."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return {str(kind).rsplit(".", 1)[-1].lower(): int(value) for kind, value in peak.items()}


def live_peaks(model, optimizer, step: Callable[[], torch.Tensor]) -> dict[str, int]:
    """The most bytes live at once during one step (:class:`~mtk.planner.live_memory.LiveMemory`) and, on
    CUDA, the allocator's own max allocated over the same step."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with (live := LiveMemory(LiveMemory.present_in(model, optimizer))):
        step()
    peaks = {"live_peak": live.peak}
    if device.type == "cuda":
        peaks["max_allocated"] = torch.cuda.max_memory_allocated(device)
    return peaks


def count_model_state(model, optimizer) -> dict[str, int]:
    """This rank's weights, gradients (one per trainable parameter) and AdamW moments, in bytes, counted
    on the live objects (``mtk plan`` predicts them exactly)."""
    params = list(model.parameters())
    moments = sum(
        local(t).numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0  # AdamW's ``step`` is a scalar
    )
    return {  # FSDP2's parameters and state: this rank's pieces
        "weights": sum(local(p).numel() * p.element_size() for p in params),
        "gradients": sum(local(p).numel() * p.element_size() for p in params if p.requires_grad),
        "optimizer": moments,
    }


def train_step(
    model, optimizer, input_ids: torch.Tensor, backward: bool = True, after_backward: Callable[[], None] | None = None
) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        loss = model(input_ids=input_ids, labels=input_ids).loss
        if backward:
            loss.backward()
        if after_backward is not None:
            after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def measure_model(
    spec: BenchSpec,
    model,
    device: torch.device,
    after_backward: Callable[[], None] | None = None,
    baseline: int = 0,
    shard_over=None,
    experts_shard_over=None,
) -> dict:
    """The common case: ``model(input_ids, labels).loss.backward()`` and an AdamW step (its state sharded
    over the ``shard_over`` group when given, experts spread over EP over ``experts_shard_over``)."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if shard_over is not None:
        shard_optimizer(optimizer, shard_over, experts_shard_over)
    step = train_step(
        model, optimizer, bench_batch(spec, model.config.vocab_size, device), after_backward=after_backward
    )
    result = measure_step(spec, step, device, baseline)
    result.model_state = count_model_state(model, optimizer)
    if spec.track_memory:
        result.memory_by_kind = track_memory_by_kind(model, optimizer, step)
        result.memory_by_kind.update(live_peaks(model, optimizer, step))
    return result.as_dict()


def bench_device() -> torch.device:
    return default_device(int(os.environ.get("LOCAL_RANK", "0")))
