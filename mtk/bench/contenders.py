"""One training step (forward, backward, AdamW step) of the same model on the same batch, done by
mtk and by its peers. Each ``run_*`` function runs inside the processes ``mtk.spawn`` starts (one per
rank, gloo on CPU) and returns what it measured on that rank.

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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from mtk.models import DTYPES, build_model, resolve_config
from mtk.parallel.trace import count_collectives

__all__ = ["BenchSpec", "RankResult", "CONTENDERS"]


@dataclass(frozen=True)
class BenchSpec:
    """What every contender runs: the model, the layout and the batch."""

    model: str
    tp: int
    pp: int
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
    dp: int = 1  # mtk only: data-parallel replicas (each the same batch); gradients averaged over them
    distributed_optimizer: bool = False  # mtk only: AdamW state sharded over the DP group
    checkpoint_dir: str | None = None  # the same weights as a local HF directory (for from_pretrained)
    pipeline_layers: tuple[int, ...] = ()  # mtk only, pp > 1: decoder layers per stage (default: even)


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
    pipeline_idle: float | None = None  # pp > 1: share of the last timed schedule spent waiting for neighbours
    reduction_s: float | None = None  # dp > 1: one DP all-reduce of this rank's gradients, ranks started together

    def as_dict(self) -> dict:
        return asdict(self)


def _batch(spec: BenchSpec, vocab: int, device) -> torch.Tensor:
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


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def _measure(
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
    _sync(device)
    times = []
    for _ in range(spec.steps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        loss = step()
        _sync(device)
        times.append(time.perf_counter() - start)
    collectives = {}
    if log is not None:
        nbytes = log.bytes_by_kind()
        collectives = {k: {"count": n, "bytes": nbytes[k]} for k, n in log.counts().items() if k != "barrier"}
    peak = _peak_memory(device)
    return RankResult(times, peak, float(loss), collectives, max(peak - baseline, 0) if baseline else 0)


def _memory_by_kind(model, optimizer, step: Callable[[], torch.Tensor]) -> dict[str, int]:
    """Live bytes by kind at the peak of one step (torch's MemTracker: parameters, gradients, activations,
    optimizer state, temporaries), exact on any device where the RSS of a CPU process is not."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return {str(kind).rsplit(".", 1)[-1].lower(): int(value) for kind, value in peak.items()}


def _live_peak(model, optimizer, step: Callable[[], torch.Tensor]) -> dict[str, int]:
    """The most bytes live at once during one step (:class:`~mtk.bench.live_memory.LiveMemory`) and, on
    CUDA, the allocator's own max allocated over the same step."""
    from mtk.bench.live_memory import LiveMemory

    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with (live := LiveMemory(LiveMemory.present_in(model, optimizer))):
        step()
    peaks = {"live_peak": live.peak}
    if device.type == "cuda":
        peaks["max_allocated"] = torch.cuda.max_memory_allocated(device)
    return peaks


def _model_state(model, optimizer) -> dict[str, int]:
    """This rank's weights, gradients (one per trainable parameter) and AdamW moments, in bytes, counted
    on the live objects (``mtk plan`` predicts them exactly)."""
    params = list(model.parameters())
    moments = sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0  # AdamW's ``step`` is a scalar
    )
    return {
        "weights": sum(p.numel() * p.element_size() for p in params),
        "gradients": sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        "optimizer": moments,
    }


def _train_step(
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


def _measure_model(
    spec: BenchSpec,
    model,
    device: torch.device,
    after_backward: Callable[[], None] | None = None,
    baseline: int = 0,
    shard_over=None,
) -> dict:
    """The common case: ``model(input_ids, labels).loss.backward()`` and an AdamW step (its state sharded
    over the ``shard_over`` group when given)."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if shard_over is not None:
        from mtk.parallel.distributed_optimizer import shard_optimizer

        shard_optimizer(optimizer, shard_over)
    step = _train_step(model, optimizer, _batch(spec, model.config.vocab_size, device), after_backward=after_backward)
    result = _measure(spec, step, device, baseline)
    result.model_state = _model_state(model, optimizer)
    if spec.track_memory:
        result.memory_by_kind = _memory_by_kind(model, optimizer, step)
        result.memory_by_kind.update(_live_peak(model, optimizer, step))
    return result.as_dict()


def _device() -> torch.device:
    from mtk.parallel.state import default_device

    return default_device(int(os.environ.get("LOCAL_RANK", "0")))


def run_mtk(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """mtk: the HF model converted by the rules (TP), cut into stages (PP)."""
    from mtk.config import RunSettings
    from mtk.convert import parallelize, parallelized
    from mtk.parallel.grads import all_reduce_coalesced, sync_sequence_parallel_grads
    from mtk.parallel.state import ParallelState
    from mtk.pipeline.engine import PipelineModel
    from mtk.recompute import enable_recompute

    torch.set_num_threads(spec.threads)
    device = _device()
    baseline = resident_memory(device)
    parallel = ParallelState.build(tp_size=spec.tp, pp_size=spec.pp, device=device)
    model = build_model(spec.model, seed=spec.seed, dtype=DTYPES[spec.dtype])
    parallelize(model, parallel, sequence_parallel=spec.sequence_parallel, pipeline_layers=spec.pipeline_layers)
    record = parallelized(model)
    enable_recompute(model, RunSettings(recompute_granularity=spec.recompute), record.rng if record else None)

    def sync_sequence_parallel() -> None:  # what the Accelerator does after backward
        if spec.sequence_parallel:
            sync_sequence_parallel_grads(model, parallel.tp_group)

    def sync_grads() -> None:  # and the DP average (DDP's job in the Accelerator; here one coalesced call)
        sync_sequence_parallel()
        all_reduce_coalesced(
            [p.grad for p in model.parameters() if p.grad is not None], parallel.dp_group, average=True
        )

    if spec.pp == 1:
        shard_over = parallel.dp_group if spec.distributed_optimizer else None
        measured = _measure_model(spec, model.to(device), device, sync_grads, baseline, shard_over)
        if parallel.dp_size > 1:
            measured["reduction_s"] = _reduction_seconds(model, parallel.dp_group, device)
        return measured
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    pipe = PipelineModel(model, parallel, spec.micro_batches)

    def forward(**batch):
        out = pipe(**batch)
        pipe.finalize_grads()
        sync_sequence_parallel()
        return out

    step = _train_step(forward, optimizer, _batch(spec, cast(Any, model).config.vocab_size, device), backward=False)
    result = _measure(spec, step, device, baseline)
    result.pipeline_idle = pipe.stats.idle_fraction
    result.model_state = _model_state(model, optimizer)
    if spec.track_memory:  # MemTracker refuses modules run once per micro-batch: live bytes only
        result.memory_by_kind = _live_peak(model, optimizer, step)
    return result.as_dict()


def _reduction_seconds(model, group, device: torch.device) -> float:
    """The DP average of a buffer the size of this rank's gradients, every rank starting together: the
    reduction a data-parallel step adds to one replica's step."""
    from mtk.parallel.grads import all_reduce_coalesced

    buffers = [torch.zeros_like(p) for p in model.parameters() if p.requires_grad]
    all_reduce_coalesced(buffers, group, average=True)  # warm-up (connections, allocation)
    dist.barrier()
    start = time.perf_counter()
    all_reduce_coalesced(buffers, group, average=True)
    _sync(device)
    return time.perf_counter() - start


def run_mtk_one_replica(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """mtk at the same TP x PP as one data-parallel replica: what a DP layout's ideal is measured from."""
    return run_mtk(rank, world_size, replace(spec, dp=1, distributed_optimizer=False))


def run_mtk_one_stage(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """mtk at the same TP with the whole model on one stage: what a pipeline's ideal is measured from."""
    return run_mtk(rank, world_size, replace(spec, pp=1, micro_batches=1, pipeline_layers=()))


def run_hf(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """Plain transformers on one process, ``spec.threads`` threads."""
    torch.set_num_threads(spec.threads)
    device = _device()
    model = build_model(spec.model, seed=spec.seed, dtype=DTYPES[spec.dtype]).to(device)
    return _measure_model(spec, model, device)


def _accelerator_loop(spec: BenchSpec, accelerator) -> dict:
    """One process, TP = 1: the loop a user writes with accelerate (prepare, backward, step)."""
    model = build_model(spec.model, seed=spec.seed, dtype=DTYPES[spec.dtype])
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    input_ids = _batch(spec, resolve_config(spec.model).vocab_size, accelerator.device)

    def step() -> torch.Tensor:
        loss = model(input_ids=input_ids, labels=input_ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return _measure(spec, step, accelerator.device).as_dict()


def run_accelerate(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """Plain accelerate's ``Accelerator`` around the HF model (what mtk's TP = 1 must not be slower than)."""
    from accelerate import Accelerator

    torch.set_num_threads(spec.threads)
    return _accelerator_loop(spec, Accelerator(cpu=_device().type == "cpu"))


def run_mtk_accelerator(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """``mtk.Accelerator`` at TP = 1, PP = 1, DP = 1: the same loop, through mtk's conversion and wrappers."""
    from mtk import Accelerator, ParallelConfig

    torch.set_num_threads(spec.threads)
    return _accelerator_loop(spec, Accelerator(parallel_config=ParallelConfig(tp_size=1, pp_size=1)))


class _TorchStage(torch.nn.Module):
    """A contiguous slice of an HF Llama-style decoder as one torch.distributed.pipelining stage: the embedding
    on the first, the final norm and head on the last; rotary embeddings recomputed on each (HF's own
    modules; causal attention without a mask)."""

    def __init__(self, model, start: int, stop: int, first: bool, last: bool) -> None:
        super().__init__()
        base = model.model
        self.embed = base.embed_tokens if first else None
        self.rotary = base.rotary_emb
        self.layers = torch.nn.ModuleList(base.layers[start:stop])
        self.norm = base.norm if last else None
        self.head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x) if self.embed is not None else x  # [b, s, h]
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]  # [1, s]
        rotary = self.rotary(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        if self.head is not None and self.norm is not None:
            return self.head(self.norm(hidden))  # [b, s, V]
        return hidden


def run_torch_pipelining(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """torch's own pipeline parallelism (``torch.distributed.pipelining``, 1F1B) on the same HF model cut into
    ``spec.pp`` even stages: the pipeline peer (Llama-style decoders)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from mtk.pipeline.stages import stage_layer_counts

    torch.set_num_threads(spec.threads)
    device = _device()
    model: Any = build_model(spec.model, seed=spec.seed, dtype=DTYPES[spec.dtype])
    if not hasattr(model, "model") or not hasattr(model.model, "rotary_emb"):
        raise RuntimeError(f"the torch.distributed.pipelining peer cuts Llama-style decoders, not {spec.model}")
    counts = stage_layer_counts(len(model.model.layers), world_size)
    start = sum(counts[:rank])
    stage_module = _TorchStage(model, start, start + counts[rank], rank == 0, rank == world_size - 1).to(device)
    stage_module.train()
    optimizer = torch.optim.AdamW(stage_module.parameters(), lr=1e-4)
    stage = PipelineStage(stage_module, rank, world_size, device)
    vocab = model.config.vocab_size

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # HF's shifted causal LM loss
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), labels[:, 1:].reshape(-1))

    schedule = Schedule1F1B(stage, n_microbatches=spec.micro_batches, loss_fn=loss_fn)
    input_ids = _batch(spec, vocab, device)

    def step() -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(input_ids)
        elif rank == world_size - 1:
            schedule.step(target=input_ids, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return torch.stack(losses).mean().detach() if losses else torch.zeros(())

    return _measure(spec, step, device, count_calls=False).as_dict()


def run_tp_plan(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """transformers' own tensor parallelism: ``from_pretrained(..., tp_plan="auto")`` (DTensor)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec.threads)
    device = _device()
    assert spec.checkpoint_dir is not None, "the tp_plan contender loads the shared weights from a directory"
    model = AutoModelForCausalLM.from_pretrained(
        spec.checkpoint_dir, tp_plan="auto", dtype=DTYPES[spec.dtype], tp_size=spec.tp
    )
    return _measure_model(spec, model, device)


def run_autotp(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """DeepSpeed AutoTP (``"tensor_parallel": {"autotp_size": N}``) with ZeRO-1, as DeepSpeed documents it."""
    import deepspeed

    from mtk.integrations.deepspeed import remove_shm_buffers_at_exit

    torch.set_num_threads(spec.threads)
    device = _device()
    model = build_model(spec.model, seed=spec.seed, dtype=DTYPES[spec.dtype])
    config = {
        "train_micro_batch_size_per_gpu": spec.batch,
        "gradient_accumulation_steps": 1,
        "tensor_parallel": {"autotp_size": spec.tp},
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "bf16": {"enabled": spec.dtype == "bf16"},
        "steps_per_print": 10**9,
    }
    remove_shm_buffers_at_exit()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    input_ids = _batch(spec, resolve_config(spec.model).vocab_size, engine.device)

    def step() -> torch.Tensor:
        loss = engine(input_ids=input_ids, labels=input_ids).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return _measure(spec, step, device).as_dict()


def run_zero(rank: int, world_size: int, spec: BenchSpec, stage: int) -> dict:
    """DeepSpeed ZeRO stage ``stage`` over ``spec.dp`` data-parallel processes (torch AdamW), each on the same
    batch as mtk's replicas: the data-parallel peer."""
    import deepspeed

    from mtk.integrations.deepspeed import remove_shm_buffers_at_exit

    torch.set_num_threads(spec.threads)
    device = _device()
    model = build_model(spec.model, seed=spec.seed, dtype=DTYPES[spec.dtype])
    config = {
        "train_micro_batch_size_per_gpu": spec.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "bf16": {"enabled": spec.dtype == "bf16"},
        "steps_per_print": 10**9,
    }
    remove_shm_buffers_at_exit()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    input_ids = _batch(spec, resolve_config(spec.model).vocab_size, engine.device)

    def step() -> torch.Tensor:
        loss = engine(input_ids=input_ids, labels=input_ids).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return _measure(spec, step, device).as_dict()


def run_zero1(rank: int, world_size: int, spec: BenchSpec) -> dict:
    return run_zero(rank, world_size, spec, 1)


def run_zero2(rank: int, world_size: int, spec: BenchSpec) -> dict:
    return run_zero(rank, world_size, spec, 2)


# name -> (worker, processes for a spec, threads per process or None for the spec's)
CONTENDERS: dict[str, tuple[Callable, Callable[[BenchSpec], int], Callable[[BenchSpec], int]]] = {
    "mtk": (run_mtk, lambda s: s.tp * s.pp * s.dp, lambda s: 1),
    "mtk-one-stage": (run_mtk_one_stage, lambda s: s.tp * s.dp, lambda s: 1),
    "mtk-one-replica": (run_mtk_one_replica, lambda s: s.tp * s.pp, lambda s: 1),
    "hf-1thread": (run_hf, lambda s: 1, lambda s: 1),
    "accelerate": (run_accelerate, lambda s: 1, lambda s: 1),
    "mtk-accelerator": (run_mtk_accelerator, lambda s: 1, lambda s: 1),
    "hf-all-threads": (run_hf, lambda s: 1, lambda s: os.cpu_count() or 1),
    "transformers-tp_plan": (run_tp_plan, lambda s: s.tp, lambda s: 1),
    "deepspeed-autotp": (run_autotp, lambda s: s.tp, lambda s: 1),
    "torch-pipelining": (run_torch_pipelining, lambda s: s.pp, lambda s: 1),
    "deepspeed-zero1": (run_zero1, lambda s: s.dp, lambda s: 1),
    "deepspeed-zero2": (run_zero2, lambda s: s.dp, lambda s: 1),
}
