"""What a fine-tuning loop builds before its first step, the same under accelerate and DeepSpeed: the starting model,
the training and evaluation data, the learning-rate schedule, and evaluation that logs.

``examples/finetune.py`` (mtk.Accelerator) and ``examples/run.py`` (a DeepSpeed engine) are two front ends of
these; a hand-written loop uses them the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from mtk.checkpoint import load_pretrained_tp
from mtk.config import RunSettings
from mtk.data import eval_batches, training_data
from mtk.errors import DataError
from mtk.models import build_model, num_layers, resolve_config, whole_parameters
from mtk.parallel.state import ParallelState
from mtk.pipeline.balance import asked_layers
from mtk.training.evaluation import evaluate
from mtk.training.signals import ExitSignal
from mtk.training.windows import StepWindow

__all__ = [
    "RunData",
    "Evaluation",
    "layout_description",
    "load_run_data",
    "starting_model",
    "step_metrics",
    "tracker_config",
    "warmup_then_linear",
]


def starting_model(
    spec: str, parallel: ParallelState, settings: RunSettings, *, seed: int, dtype: torch.dtype | None = None
) -> nn.Module:
    """A local HF directory, converted and holding only this rank's slices (and stage); or a built-in config built
    whole from ``seed`` on every rank (the same weights at every layout), for the caller to convert. Whole under
    accelerate's DeepSpeed ZeRO-3 too (:func:`mtk.models.whole_parameters`): DeepSpeed partitions it later."""
    with whole_parameters():
        return _starting_model(spec, parallel, settings, seed=seed, dtype=dtype)


def _starting_model(
    spec: str, parallel: ParallelState, settings: RunSettings, *, seed: int, dtype: torch.dtype | None
) -> nn.Module:
    if Path(spec).is_dir():
        model = load_pretrained_tp(
            spec,
            parallel,
            dtype=dtype,
            pipeline_layers=asked_layers(settings, num_layers(resolve_config(spec)), parallel.pp_size),
            virtual_stages=settings.virtual_stages if parallel.pp_size > 1 else 1,
            sequence_parallel=settings.sequence_parallel,
            loss_chunk_tokens=settings.loss_chunk_tokens,
        )
        return model.train()
    return build_model(spec, seed=seed, dtype=dtype or torch.float32)


@dataclass
class RunData:
    """The training examples (or packed rows), their collator, and this replica's evaluation batches."""

    train: Any
    collate: Callable[[list], dict[str, torch.Tensor]]
    evaluation: list[dict[str, torch.Tensor]] = field(default_factory=list)
    format: str = "text"  # --data's: text, messages or prompt_completion (formats.detect_format)


def load_run_data(
    data: str,
    eval_data: str | None,
    tokenizer: Any,
    seq_len: int,
    parallel: ParallelState,
    *,
    batch_size: int,
    packing: bool,
    loss_on: str,
    pad_to_multiple_of: int = 1,
    report: Callable[[str], None] = print,
) -> RunData:
    """``--data`` and ``--eval_data`` tokenized (each summarised in one ``report`` line); one line if there is not
    one batch per DP replica."""
    train, collate, summary = training_data(
        data, tokenizer, seq_len, packing=packing, loss_on=loss_on, pad_to_multiple_of=pad_to_multiple_of
    )
    report(f"mtk: --data {data}: {summary.describe(seq_len)}")
    if len(train) < batch_size * parallel.dp_size:
        raise DataError(
            f"--data {data} gives {len(train)} {'rows' if packing else 'examples'}, fewer than one batch of "
            f"--batch_size {batch_size} x dp {parallel.dp_size}; give more data or a smaller batch"
        )
    run = RunData(train, collate, format=summary.format)
    if eval_data:
        examples, _, eval_summary = training_data(
            eval_data,
            tokenizer,
            seq_len,
            packing=packing,
            loss_on=loss_on,
            source="--eval_data",
            pad_to_multiple_of=pad_to_multiple_of,
        )
        report(f"mtk: --eval_data {eval_data}: {eval_summary.describe(seq_len)}")
        run.evaluation = eval_batches(examples, collate, batch_size, parallel.dp_rank, parallel.dp_size)
    return run


def warmup_then_linear(warmup_steps: int, total_steps: int, calls_per_step: int = 1) -> Callable[[int], float]:
    """A ``LambdaLR`` factor: linear warm-up over ``warmup_steps`` optimizer steps, then linear decay to 0 at
    ``total_steps``. ``calls_per_step``: how often the scheduler is stepped per optimizer step (mtk.Accelerator's
    prepared scheduler steps once per DP replica, accelerate's convention; a DeepSpeed engine once)."""
    warmup, total = max(warmup_steps, 1), max(total_steps, 1)

    def factor(calls: int) -> float:
        step = calls // calls_per_step
        return min(1.0, (step + 1) / warmup) * max(0.0, 1 - step / total)

    return factor


@dataclass
class Evaluation:
    """Evaluation that logs: ``evaluation(step)`` evaluates ``batches`` (:func:`mtk.training.evaluation.evaluate`),
    ``log``s the scores and prints them on the main process. Collective."""

    model: nn.Module
    batches: list[dict[str, torch.Tensor]]
    device: torch.device
    sum_over_replicas: Callable[[torch.Tensor], torch.Tensor]
    exit_signal: ExitSignal
    log: Callable[[dict[str, float], int], None]
    main_process: bool
    every: int = 0  # steps between evaluations (0: only at the end)

    def due(self, step: int, last_step: int) -> bool:
        """Whether to evaluate after ``step``: every ``every`` steps and after the last, if there is data."""
        return bool(self.batches) and ((self.every > 0 and step % self.every == 0) or step == last_step)

    def __call__(self, at_step: int) -> bool:
        """``False`` when a signal cut the evaluation short (then nothing is logged)."""
        scores = evaluate(
            self.model, self.batches, self.device, self.sum_over_replicas, stop=self.exit_signal.requested
        )
        if scores is None:
            if self.main_process:
                tqdm.write(f"mtk: {self.exit_signal.name}: the evaluation at step {at_step} stopped early, not logged")
            return False
        self.log(scores, at_step)
        if self.main_process:  # on its own line, under a progress bar
            loss, perplexity = scores["eval/loss"], scores["eval/perplexity"]
            tqdm.write(f"eval at step {at_step}: loss {loss!r} perplexity {perplexity:.3f}")
        return True


def layout_description(parallel: ParallelState, settings: RunSettings) -> str:
    """``tp=2 pp=2 (1f1b, 4 micro-batches) dp=2 world=8``: the start-up line's layout (``cp=2 (p2p)`` after the TP
    size with context parallelism, `` ep=2`` after the DP size with expert parallelism, `` etp=1`` with the experts
    whole on each TP rank)."""
    schedule = ""
    if parallel.pp_size > 1:
        chunks = f" x {settings.virtual_stages} chunks" if settings.virtual_stages > 1 else ""
        schedule = f" ({settings.pipeline_schedule}{chunks}, {settings.num_micro_batches} micro-batches)"
    cp = f" cp={parallel.cp_size} ({settings.cp_comm_type})" if parallel.cp_size > 1 else ""
    ep = f" ep={parallel.ep_size}" if parallel.ep_size > 1 else ""
    ep += f" etp={parallel.etp_size}" if parallel.etp_size != parallel.tp_size else ""
    return (
        f"tp={parallel.tp_size}{cp} pp={parallel.pp_size}{schedule} dp={parallel.dp_size}{ep} "
        f"world={parallel.world_size}"
    )


def tracker_config(flags: dict[str, Any], parallel: ParallelState, settings: RunSettings, **run: Any) -> dict:
    """The hyper-parameters a tracker records: the script's flags (tensorboard takes scalars and strings: tuples
    joined, unset ones left out), the layout, and ``run``'s derived values (global batch, ...)."""
    hparams = {k: ",".join(map(str, v)) if isinstance(v, tuple) else v for k, v in flags.items() if v is not None}
    sizes = ("tp_size", "cp_size", "pp_size", "dp_size", "ep_size", "etp_size")
    layout = {name: getattr(parallel, name) for name in sizes}
    return {**hparams, **layout, "micro_batches": settings.num_micro_batches, **run}


def step_metrics(
    window: StepWindow, loss: float, lr: float, grad_norm: float | None, elapsed_s: float, dp_size: int
) -> dict[str, float]:
    """What a step logs: its token-mean loss, learning rate, gradient norm, labelled tokens and throughput
    (positions per second over the whole job, padding included)."""
    return {
        "train/loss": loss,
        "train/lr": lr,
        "train/grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
        "train/loss_tokens": window.labelled.item(),
        "train/tokens_per_s": window.tokens() * dp_size / elapsed_s,
    }
