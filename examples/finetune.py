"""Causal-LM fine-tuning with tensor/data parallelism through Accelerate.

    accelerate launch --config_file accelerate_configs/tp2.yaml examples/finetune.py
    accelerate launch --config_file accelerate_configs/tp2.yaml examples/finetune.py --resume ckpts/step_20

Defaults: the built-in ``tiny-llama`` config (random weights) on the bundled examples/data/sample.jsonl;
its loss falls from ~5.6 to ~2 within a minute on 2 CPU cores. ``--model`` also takes a local HF
directory (loaded slice by slice, its tokenizer if it has one). ``--data`` holds ``text``, ``messages``
(chat, rendered by the tokenizer's template, loss on the assistant turns) or ``prompt`` + ``completion``
rows (docs/data.md); ``--packing`` packs examples into ``--seq_len`` rows. The loss of a step is the
mean over every token with a label in the whole global batch, whatever the layout. It is a plain
accelerate loop: only the Accelerator comes from mtk.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C while the libraries below load (seconds): stop quietly, not their traceback
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)  # (run_main says it in one line from then on)

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from mtk import Accelerator
from mtk.args import (
    ArgumentParser,
    add_recompute_argument,
    add_safety_arguments,
    collective_timeout,
    directory,
    non_negative_int,
    positive_float,
    positive_int,
    seed,
)
from mtk.checkpoint.resume import ResumeGuard, add_resume_arguments, start_point
from mtk.config import CP_COMM_TYPES, PIPELINE_SCHEDULES, RunSettings
from mtk.data import FORMATS, LOSS_ON, add_tokenizer_argument, tokenizer_for
from mtk.errors import DataError
from mtk.integrations.accelerate.save import check_target, save_pretrained
from mtk.lora import get_peft_model
from mtk.lora.options import add_lora_arguments, base_dtype, lora_config
from mtk.models import check_seq_len, resolve_config
from mtk.parallel.grad_norm import check_finite
from mtk.parallel.placement import placement
from mtk.rules import check_tp_size
from mtk.training.boundary import StepBoundary
from mtk.training.entry import run_main
from mtk.training.evaluation import peak_memory_mib
from mtk.training.setup import (
    Evaluation,
    RunData,
    layout_description,
    load_run_data,
    starting_model,
    step_metrics,
    tracker_config,
    warmup_then_linear,
)
from mtk.training.signals import ExitSignal

HERE = Path(__file__).resolve().parent


def layer_counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer counts, e.g. 3,1") from None


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama", help="built-in config name or local HF directory")
    add_tokenizer_argument(parser)
    parser.add_argument(
        "--data",
        default=str(HERE / "data" / "sample.jsonl"),
        help=f"local {'/'.join(FORMATS)} file, a folder of them, or a save_to_disk folder; "
        "columns text, messages, or prompt + completion",
    )
    parser.add_argument(
        "--loss_on",
        choices=LOSS_ON,
        default="assistant",
        help="messages: assistant turns only (default) or all tokens; prompt + completion: the completion or all",
    )
    parser.add_argument("--packing", action="store_true", help="pack examples into --seq_len rows (else pad)")
    parser.add_argument("--eval_data", help="evaluation rows, in any --data format (default: no evaluation)")
    parser.add_argument(
        "--eval_every", type=non_negative_int, default=0, help="evaluate every N steps (0: only at the end)"
    )
    parser.add_argument("--max_steps", type=positive_int, default=60, help="optimizer steps to run (default 60)")
    parser.add_argument(
        "--save_every", type=non_negative_int, default=0, help="save_state every N steps (0: only at the end)"
    )
    parser.add_argument(
        "--output_dir", type=directory, default="ckpts", help="checkpoints and tensorboard runs/ (default ckpts)"
    )
    add_resume_arguments(parser)
    parser.add_argument("--seed", type=seed, default=0)
    parser.add_argument("--lr", type=positive_float, default=3e-3)
    parser.add_argument("--warmup_steps", type=non_negative_int, default=5)
    parser.add_argument("--batch_size", type=positive_int, default=8, help="micro-batch per data-parallel replica")
    parser.add_argument(
        "--grad_accum",
        type=positive_int,
        help="micro-batches per optimizer step (default 1; under DeepSpeed what the JSON's batch fields give)",
    )
    parser.add_argument("--seq_len", type=positive_int, default=128, help="longest example (longer ones are cut)")
    parser.add_argument(
        "--max_grad_norm", type=positive_float, help="default: megatron_lm_gradient_clipping, else 1.0"
    )
    parser.add_argument("--save_model", help="write the trained model here with save_pretrained at the end")
    parser.add_argument(
        "--pipeline_schedule", choices=PIPELINE_SCHEDULES, help="pp > 1 (default: MTK_PIPELINE_SCHEDULE, else 1f1b)"
    )
    parser.add_argument(
        "--virtual_stages",
        type=positive_int,
        help="model chunks per pipeline rank for --pipeline_schedule interleaved (default: MTK_VIRTUAL_STAGES)",
    )
    parser.add_argument(
        "--loss_chunk_tokens",
        type=non_negative_int,
        help="tokens per chunk of the loss that never holds the logits; 0: off (default: MTK_LOSS_CHUNK_TOKENS, "
        "else chunks of at most 256 MiB of fp32 logits)",
    )
    parser.add_argument(
        "--cp_comm_type",
        choices=CP_COMM_TYPES,
        help="context parallelism's attention (megatron_lm_context_parallel_size > 1): ring (p2p) or all-to-all "
        "(a2a) (default: MTK_CP_COMM_TYPE, else p2p)",
    )
    add_safety_arguments(parser)
    add_recompute_argument(parser)
    add_lora_arguments(parser)
    parser.add_argument(
        "--pipeline_layers",
        type=layer_counts,
        help="decoder layers per stage (per model chunk with --virtual_stages), e.g. 3,1 (default: "
        "MTK_PIPELINE_LAYERS, else even with the LM head counted as layers of the last stage)",
    )
    return parser.parse_args(argv)


def build_accelerator(args: argparse.Namespace) -> Accelerator:
    """accelerate's Accelerator with mtk's layout from the launcher's config; the flags beat its variables."""
    return Accelerator(
        gradient_accumulation_steps=args.grad_accum,
        log_with="tensorboard",
        project_dir=args.output_dir,
        # shuffle order as a function of (seed, epoch): resume is exact whatever else used the RNGs
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=collective_timeout(args))],
        # flags beat the launcher's variables (an override is reported in one line)
        run_settings=RunSettings.from_env(
            pipeline_schedule=args.pipeline_schedule,
            pipeline_layers=args.pipeline_layers,
            virtual_stages=args.virtual_stages,
            loss_chunk_tokens=args.loss_chunk_tokens,
            cp_comm_type=args.cp_comm_type,
            gradient_clipping=args.max_grad_norm,
            recompute_granularity="full" if args.gradient_checkpointing else None,
        ),
    )


def build_model(args: argparse.Namespace, accelerator: Accelerator) -> tuple[torch.nn.Module, Any]:
    """The starting model (a directory: only this rank's slices are read), LoRA on its parallel layers if asked,
    and its tokenizer; one clear line for a model the layout cannot split."""
    parallel = accelerator.parallel
    config = resolve_config(args.model)
    check_tp_size(config, parallel.tp_size)  # one clear line before anything is built
    check_seq_len(config, args.seq_len)
    lora = lora_config(args)
    dtype = base_dtype(args) if lora else None
    set_seed(args.seed)
    model = starting_model(args.model, parallel, accelerator.settings, seed=args.seed, dtype=dtype)
    if lora:  # PEFT's LoRA on the parallel layers: only the adapters train, checkpoint and export
        model = get_peft_model(accelerator.parallelize(model), lora, report=accelerator.print)
    tokenizer = tokenizer_for(args.model, args.tokenizer, model.config.vocab_size)
    if Path(args.model).is_dir() or args.tokenizer:
        accelerator.checkpoint_tokenizer = tokenizer  # checkpoints (and `mtk export`) carry it
    return model, tokenizer


def build_data(args: argparse.Namespace, accelerator: Accelerator, tokenizer: Any) -> tuple[RunData, DataLoader]:
    """The training rows (and evaluation batches) and the training loader, which shuffles with its own generator:
    starting an epoch never moves the global RNG (dropout), so resume is exact."""
    parallel, settings = accelerator.parallel, accelerator.settings
    if args.eval_every and not args.eval_data:
        raise DataError("--eval_every needs --eval_data (the rows to evaluate on)")
    data = load_run_data(
        args.data,
        args.eval_data,
        tokenizer,
        args.seq_len,
        parallel,
        batch_size=args.batch_size,
        packing=args.packing,
        loss_on=args.loss_on,
        # sequence parallelism splits every row over the TP ranks: rows a multiple of tp long save mtk's padding
        pad_to_multiple_of=parallel.tp_size if settings.sequence_parallel else 1,
        report=accelerator.print,
    )
    if args.packing and settings.eod_mask_loss is False:  # accelerate exports False unless the YAML says true
        accelerator.print(
            "mtk: megatron_lm_eod_mask_loss=False overridden: packed rows never train an example's first token "
            "on the example before it (as eod_mask_loss=True), so packed training equals unpacked"
        )
    loader_rng = torch.Generator().manual_seed(args.seed)
    loader = DataLoader(
        data.train, args.batch_size, shuffle=True, drop_last=True, generator=loader_rng, collate_fn=data.collate
    )
    return data, loader


def step_boundary(
    args: argparse.Namespace,
    accelerator: Accelerator,
    model: torch.nn.Module,
    eval_batches: list[dict[str, torch.Tensor]],
    exit_signal: ExitSignal,
    step: int,
) -> StepBoundary:
    """What happens between steps: evaluation (summed over the DP replicas, logged to the trackers) when due, a
    signal agreed over the ranks, ``step_N`` saved by accelerate's ``save_state``."""
    evaluation = Evaluation(
        model,
        eval_batches,
        accelerator.device,
        lambda t: accelerator.reduce(t, "sum"),
        exit_signal,
        log=lambda scores, at: accelerator.log(scores, step=at),
        main_process=accelerator.is_main_process,
        every=args.eval_every,
    )
    return StepBoundary(
        accelerator.save_state,
        args.output_dir,
        args.save_every,
        args.max_steps,
        evaluation,
        exit_signal,
        report=accelerator.print,
        saved_step=step,
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    accelerator = build_accelerator(args)
    if args.save_model:  # before hours of training, not after; as the main process, which writes it, sees it
        check_target(args.save_model, args.output_dir, accelerator)
    parallel, settings = accelerator.parallel, accelerator.settings
    # SIGTERM/SIGINT/SIGHUP from here on: save at the next step boundary and exit (a second one: stop at once)
    exit_signal = ExitSignal(accelerator.device)
    accelerator.print(placement(parallel).describe())  # which node each rank is on; TP groups inside nodes
    resume = start_point(args, main_process=accelerator.is_main_process, barrier=accelerator.wait_for_everyone)
    model, tokenizer = build_model(args, accelerator)
    data, loader = build_data(args, accelerator, tokenizer)
    trainable = [p for p in model.parameters() if p.requires_grad]  # all of them, or the adapters
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    # accelerate steps a prepared scheduler dp_size times per optimizer step (its convention for
    # schedules written in single-process steps)
    lr_factor = warmup_then_linear(args.warmup_steps, args.max_steps, calls_per_step=parallel.dp_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accum = accelerator.gradient_accumulation_steps  # --grad_accum, or under DeepSpeed the JSON's: the engine's
    global_batch = args.batch_size * parallel.dp_size * accum  # sequences per optimizer step
    hparams = tracker_config(
        vars(args), parallel, settings, global_batch_size=global_batch, gradient_accumulation_steps=accum
    )
    accelerator.init_trackers("runs", hparams)
    max_grad_norm = settings.gradient_clipping or 1.0  # --max_grad_norm, else megatron_lm_gradient_clipping

    # a resumed run must continue the same data stream: a changed one of these is one clear line
    accelerator.register_for_checkpointing(ResumeGuard.from_args(args, data.format))
    step = 0
    if resume:
        accelerator.load_state(resume)  # weights, optimizer, scheduler, RNG, data position
        step = accelerator.completed_steps
    if step >= args.max_steps:  # e.g. a requeued job whose last run finished
        accelerator.print(f"mtk: {resume} is at step {step}, --max_steps is {args.max_steps}: nothing left to do")
        accelerator.end_training()
        return
    model_type = accelerator.unwrap_model(model).config.model_type
    accelerator.print(
        f"mtk: {model_type} {layout_description(parallel, settings)}, global batch {global_batch} "
        f"{'rows' if args.packing else 'examples'}, steps {step}->{args.max_steps}"
    )
    boundary = step_boundary(args, accelerator, model, data.evaluation, exit_signal, step)
    if not boundary.begin():  # a fresh run evaluates its starting point; a signal during it: nothing to save
        accelerator.end_training()
        return
    progress = tqdm(total=args.max_steps, initial=step, disable=not accelerator.is_main_process, desc="train")
    loss_sum, tic = torch.zeros((), device=accelerator.device), time.perf_counter()
    # One optimizer step's micro-batches at a time, from where the run is: each passes num_items_in_batch (the
    # global batch's labelled tokens / (accum x dp)), so the step's loss is the global batch's token mean.
    for window in accelerator.step_windows(loader):
        for batch, last in window.micro_batches():
            with accelerator.accumulate(model, sync=last):
                # With pp > 1 this call runs the pipeline schedule (forward and backward over
                # micro-batches) and backward() only syncs gradients; the loop is the same.
                # no KV cache: training needs none, and transformers detects packed rows only without one
                loss = model(**batch, num_items_in_batch=window.num_items, use_cache=False).loss
                accelerator.backward(loss)
                loss_sum += loss.detach().float()
                finite = True
                if last:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                    finite = check_finite(grad_norm, step + 1, skip=args.skip_nonfinite)  # global: all agree
                if finite:
                    optimizer.step()
                    scheduler.step()
                optimizer.zero_grad()
        step += 1
        # mean over micro-batches and DP of losses weighted as above = the global batch's token mean
        mean_loss = accelerator.reduce(loss_sum / accum, "mean").item()
        elapsed, tic = time.perf_counter() - tic, time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        accelerator.log(step_metrics(window, mean_loss, lr, grad_norm, elapsed, parallel.dp_size), step=step)
        if accelerator.is_main_process:
            progress.write(f"step {step} loss {mean_loss!r}")  # full precision: runs are compared exactly
        progress.update(1)
        progress.set_postfix(loss=f"{mean_loss:.3f}")
        loss_sum.zero_()
        if boundary.after(step):  # evaluation when due, a signal agreed over the ranks, step_N saved
            break
    progress.close()
    boundary.finish(step)
    if args.save_model and not boundary.stopped:  # the HF directory: save_pretrained of the gathered model, staged
        save_pretrained(accelerator, model, args.save_model, tokenizer)
    peaks = peak_memory_mib(accelerator.device)
    accelerator.print(f"mtk: peak memory per rank (MiB): {' '.join(f'{p:.0f}' for p in peaks)}")
    held = accelerator.held_elements()  # what TP, FSDP2, a distributed optimizer or ZeRO left rank 0
    accelerator.print(
        f"mtk: model state held by rank 0: {held['parameters']} parameter elements, "
        f"{held['optimizer_state']} optimizer-state elements"
    )
    accelerator.end_training()
    if not math.isfinite(mean_loss):
        sys.exit(f"training diverged: loss {mean_loss}")


if __name__ == "__main__":
    run_main(main, "finetune.py")
