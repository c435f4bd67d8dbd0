"""mtk's peers in ``mtk bench``: plain transformers, accelerate's own loop, transformers' ``tp_plan``, DeepSpeed
AutoTP, AutoEP and ZeRO, and torch's ``torch.distributed.pipelining``, each on the same weights and batch as mtk.
"""

from __future__ import annotations

from typing import Any

import torch

from mtk.bench.measure import BenchSpec, bench_batch, bench_device, measure_model, measure_step
from mtk.config import ParallelConfig
from mtk.integrations.accelerate import Accelerator
from mtk.integrations.deepspeed import remove_shm_buffers_at_exit
from mtk.models import DTYPES, build_model, resolve_config
from mtk.pipeline.balance import layer_counts

__all__ = [
    "run_accelerate",
    "run_autoep",
    "run_autotp",
    "run_hf",
    "run_mtk_accelerator",
    "run_torch_pipelining",
    "run_tp_plan",
    "run_zero1",
    "run_zero2",
]


def run_hf(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """Plain transformers on one process, ``spec.threads`` threads."""
    torch.set_num_threads(spec.threads)
    device = bench_device()
    model = build_model(spec.model, seed=spec.seed, dtype=DTYPES[spec.dtype]).to(device)
    return measure_model(spec, model, device)


def _accelerator_loop(spec: BenchSpec, accelerator) -> dict:
    """One process, TP = 1: the loop a user writes with accelerate (prepare, backward, step)."""
    model = build_model(spec.model, seed=spec.seed, dtype=DTYPES[spec.dtype])
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    input_ids = bench_batch(spec, resolve_config(spec.model).vocab_size, accelerator.device)

    def step() -> torch.Tensor:
        loss = model(input_ids=input_ids, labels=input_ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return measure_step(spec, step, accelerator.device).as_dict()


def run_accelerate(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """Plain accelerate's ``Accelerator`` around the HF model (what mtk's TP = 1 must not be slower than)."""
    from accelerate import Accelerator

    torch.set_num_threads(spec.threads)
    return _accelerator_loop(spec, Accelerator(cpu=bench_device().type == "cpu"))


def run_mtk_accelerator(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """``mtk.Accelerator`` at TP = 1, PP = 1, DP = 1: the same loop, through mtk's conversion and wrappers."""
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
    """torch's own pipeline parallelism (``torch.distributed.pipelining``) on the same HF model cut as mtk cuts
    it (``spec.pipeline_layers``, else mtk's default split), with the same schedule: ``Schedule1F1B``,
    ``ScheduleGPipe`` for afab, ``ScheduleInterleaved1F1B`` over ``spec.virtual_stages`` stages per rank: the
    pipeline peer (Llama-style decoders)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    torch.set_num_threads(spec.threads)
    device = bench_device()
    model: Any = build_model(spec.model, seed=spec.seed, dtype=DTYPES[spec.dtype])
    if not hasattr(model, "model") or not hasattr(model.model, "rotary_emb"):
        raise RuntimeError(f"the torch.distributed.pipelining peer cuts Llama-style decoders, not {spec.model}")
    chunks = world_size * spec.virtual_stages  # model chunk k runs on rank k % world_size, as in mtk
    counts = layer_counts(model.config, chunks, spec.pipeline_layers)
    modules = [
        _TorchStage(model, sum(counts[:k]), sum(counts[: k + 1]), k == 0, k == chunks - 1).to(device).train()
        for k in range(rank, chunks, world_size)
    ]
    optimizer = torch.optim.AdamW([p for module in modules for p in module.parameters()], lr=1e-4)
    stages: list[Any] = [PipelineStage(m, k, chunks, device) for m, k in zip(modules, range(rank, chunks, world_size))]
    vocab = model.config.vocab_size

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # HF's shifted causal LM loss
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), labels[:, 1:].reshape(-1))

    if spec.pipeline_schedule == "interleaved":
        schedule: Any = ScheduleInterleaved1F1B(stages, n_microbatches=spec.micro_batches, loss_fn=loss_fn)
    else:
        single = ScheduleGPipe if spec.pipeline_schedule == "afab" else Schedule1F1B
        schedule = single(stages[0], n_microbatches=spec.micro_batches, loss_fn=loss_fn)
    input_ids = bench_batch(spec, vocab, device)

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

    return measure_step(spec, step, device, count_calls=False).as_dict()


def run_tp_plan(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """transformers' own tensor parallelism: ``from_pretrained(..., tp_plan="auto")`` (DTensor)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec.threads)
    device = bench_device()
    assert spec.checkpoint_dir is not None, "the tp_plan contender loads the shared weights from a directory"
    model = AutoModelForCausalLM.from_pretrained(
        spec.checkpoint_dir, tp_plan="auto", dtype=DTYPES[spec.dtype], tp_size=spec.tp_size
    )
    return measure_model(spec, model, device)


def _deepspeed_run(spec: BenchSpec, zero_stage: int, **extra: Any) -> dict:
    """The HF model under ``deepspeed.initialize`` (torch AdamW, ZeRO ``zero_stage``, ``extra`` config keys)."""
    import deepspeed

    torch.set_num_threads(spec.threads)
    device = bench_device()
    model = build_model(spec.model, seed=spec.seed, dtype=DTYPES[spec.dtype])
    config = {
        "train_micro_batch_size_per_gpu": spec.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": zero_stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "bf16": {"enabled": spec.dtype == "bf16"},
        "steps_per_print": 10**9,
        **extra,
    }
    remove_shm_buffers_at_exit()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    input_ids = bench_batch(spec, resolve_config(spec.model).vocab_size, engine.device)

    def step() -> torch.Tensor:
        loss = engine(input_ids=input_ids, labels=input_ids).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return measure_step(spec, step, device).as_dict()


def run_autotp(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """DeepSpeed AutoTP (``"tensor_parallel": {"autotp_size": N}``) with ZeRO-1, as DeepSpeed documents it."""
    return _deepspeed_run(spec, 1, tensor_parallel={"autotp_size": spec.tp_size})


def run_zero(rank: int, world_size: int, spec: BenchSpec, stage: int) -> dict:
    """DeepSpeed ZeRO stage ``stage`` over ``spec.dp_size`` data-parallel processes, each on the same batch as mtk's
    replicas: the data-parallel peer."""
    return _deepspeed_run(spec, stage)


def run_zero1(rank: int, world_size: int, spec: BenchSpec) -> dict:
    return run_zero(rank, world_size, spec, 1)


def run_zero2(rank: int, world_size: int, spec: BenchSpec) -> dict:
    return run_zero(rank, world_size, spec, 2)


def _string_keyed_capture_registry() -> None:
    """DeepSpeed 0.19.8's AutoEP moves the model's router-logits recorder with a plain dict's calls on transformers'
    output-capturing registry (``auto_ep_presets/base.py``: ``registry.get(class_name, default)``,
    ``registry[class_name] = ...``); transformers 5.24 made that registry a dict subclass whose ``get`` and
    ``__setitem__`` take a model, and ``deepspeed.initialize`` fails with a TypeError. In the AutoEP contender's
    processes only, string keys are served as a dict serves them (models as transformers does)."""
    from transformers.utils import output_capturing

    registry: Any = getattr(output_capturing, "_CanRecordRegistry", None)
    if registry is None or getattr(registry, "mtk_string_keys", False):
        return
    by_model_get, by_model_set = registry.get, registry.__setitem__

    def get(self, key, *default):
        return dict.get(self, key, *default) if isinstance(key, str) else by_model_get(self, key)

    def set_item(self, key, value):
        return dict.__setitem__(self, key, value) if isinstance(key, str) else by_model_set(self, key, value)

    registry.get, registry.__setitem__, registry.mtk_string_keys = get, set_item, True


def run_autoep(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """DeepSpeed AutoEP (``"expert_parallel": {"autoep_size": N, "preset_model": <model type>}``: dropless, the
    model's router and aux loss kept) with ZeRO-1 over the same DP processes as mtk's EP: the expert-parallel peer.
    Its grouped matmul on GPUs only (on CPU it measured slower than its per-expert loop)."""
    _string_keyed_capture_registry()
    autoep = {
        "enabled": True,
        "autoep_size": spec.ep_size,
        "preset_model": resolve_config(spec.model).model_type,
        "use_grouped_mm": bench_device().type == "cuda",
    }
    return _deepspeed_run(spec, 1, expert_parallel=autoep)
