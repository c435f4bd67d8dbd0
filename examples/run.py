"""Causal-LM fine-tuning with Megatron tensor parallelism next to DeepSpeed ZeRO (over DP only).

    deepspeed --num_gpus 4 examples/run.py --deepspeed --deepspeed_config ds_configs/zero2.json --tp 2
    deepspeed --hostfile hostfile examples/run.py --deepspeed --deepspeed_config ds_configs/zero2.json --tp 2
    deepspeed --num_gpus 4 examples/run.py --deepspeed --deepspeed_config ds_configs/zero2.json --tp 2 \\
        --resume ckpts/step_20

DeepSpeed's launcher and argument conventions (``--deepspeed``, ``--deepspeed_config``,
``--local_rank``); the training options are those of examples/finetune.py. The TP size comes from
``--tp`` (default: ``MEGATRON_LM_TP_DEGREE``, else 1); the data-parallel size is world / tp, and ZeRO
partitions over it. The JSON's train_batch_size, train_micro_batch_size_per_gpu and
gradient_accumulation_steps follow DeepSpeed's rule (global = micro x accumulation x dp);
--batch_size/--grad_accum override theirs, in one line (README, "Batch sizes"). Tensorboard scalars go to
``<output_dir>/runs`` as in finetune.py.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C while the libraries below load (seconds): stop quietly, not their traceback
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)  # (run_main says it in one line from then on)

import argparse
import contextlib
import functools
import os
import time
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

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
from mtk.checkpoint.extras import write_generation_config, write_tokenizer
from mtk.checkpoint.resume import ResumeGuard, add_resume_arguments, data_position, rescaled_position, start_point
from mtk.config import CP_COMM_TYPES, RunSettings
from mtk.convert import parallelize
from mtk.data import FORMATS, LOSS_ON, add_tokenizer_argument, tokenizer_for
from mtk.errors import DataError
from mtk.integrations.deepspeed import (
    check_launcher_config,
    check_precision,
    deepspeed_config,
    held_elements,
    initialization_cleanup,
    load_deepspeed_checkpoint,
    optimizer_and_schedule,
    partition_over_replicas,
    remove_shm_buffers_at_exit,
    save_deepspeed_checkpoint,
    standalone_environment,
    sums_over_context_parallel,
)
from mtk.integrations.deepspeed_batch import dp_layout
from mtk.integrations.deepspeed_experts import (
    check_deepspeed_experts,
    named_param_groups,
    prepare_experts_for_deepspeed,
    spread_experts_seen_as_moe,
)
from mtk.integrations.deepspeed_norm import clip_where_deepspeed_keeps_no_norm
from mtk.lora import get_peft_model
from mtk.lora.options import add_lora_arguments, base_dtype, lora_config
from mtk.models import check_seq_len, resolve_config
from mtk.parallel.comm import all_reduce
from mtk.parallel.context import attach_context_parallel
from mtk.parallel.grad_norm import check_finite
from mtk.parallel.placement import placement
from mtk.parallel.recompute import enable_recompute
from mtk.parallel.record import hf_model, parallelized
from mtk.parallel.state import ParallelState
from mtk.rules import check_tp_size
from mtk.training.boundary import StepBoundary
from mtk.training.entry import run_main
from mtk.training.setup import Evaluation, RunData, load_run_data, starting_model, step_metrics, warmup_then_linear
from mtk.training.signals import ExitSignal
from mtk.training.windows import step_windows

HERE = Path(__file__).resolve().parent


def run_settings(args: argparse.Namespace) -> RunSettings:
    """``--loss_chunk_tokens`` and ``--cp_comm_type``, else ``MTK_LOSS_CHUNK_TOKENS`` and ``MTK_CP_COMM_TYPE`` (the
    only mtk run settings this DeepSpeed script reads from the environment; an override is reported in one line)."""
    read = ("MTK_LOSS_CHUNK_TOKENS", "MTK_CP_COMM_TYPE")
    return RunSettings.from_env(env={k: v for k, v in os.environ.items() if k in read},
                                loss_chunk_tokens=args.loss_chunk_tokens, cp_comm_type=args.cp_comm_type)  # fmt: skip


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
    parser.add_argument("--loss_on", choices=LOSS_ON, default="assistant", help="as in examples/finetune.py")
    parser.add_argument("--packing", action="store_true", help="pack examples into --seq_len rows (else pad)")
    parser.add_argument("--eval_data", help="evaluation rows, in any --data format (default: no evaluation)")
    parser.add_argument(
        "--eval_every", type=non_negative_int, default=0, help="evaluate every N steps (0: only at the end)"
    )
    parser.add_argument("--max_steps", type=positive_int, default=60)
    parser.add_argument(
        "--save_every", type=non_negative_int, default=0, help="checkpoint every N steps (0: only at the end)"
    )
    parser.add_argument("--output_dir", type=directory, default="ckpts")
    add_resume_arguments(parser)
    parser.add_argument("--seed", type=seed, default=0)
    parser.add_argument(
        "--lr", type=positive_float, help="default: the JSON optimizer's lr, else 3e-3 (the flag overrides it, said)"
    )
    parser.add_argument("--warmup_steps", type=non_negative_int, default=5)
    parser.add_argument("--batch_size", type=positive_int, help="micro-batch per DP replica (default: from the JSON)")
    parser.add_argument("--grad_accum", type=positive_int, help="micro-batches per step (default: from the JSON)")
    parser.add_argument("--seq_len", type=positive_int, default=128, help="longest example (longer ones are cut)")
    parser.add_argument(
        "--tp", type=positive_int, help="tensor-parallel size (default: MEGATRON_LM_TP_DEGREE, else 1)"
    )
    parser.add_argument(
        "--cp",
        type=positive_int,
        help="context-parallel size: each sequence split over this many ranks (default: "
        "MEGATRON_LM_CONTEXT_PARALLEL_SIZE, else 1)",
    )
    parser.add_argument(
        "--ep",
        type=positive_int,
        help="expert-parallel size on an MoE model: each layer's experts spread over this many data-parallel ranks, "
        "ZeRO 0-2 (default: MEGATRON_LM_EXPERT_MODEL_PARALLEL_SIZE, else 1)",
    )
    parser.add_argument(
        "--etp",
        type=positive_int,
        help="the experts' TP size: the TP size (each expert split over TP) or 1 (every expert whole on each TP rank) "
        "(default: MEGATRON_LM_EXPERT_TENSOR_PARALLEL_SIZE, else the TP size)",
    )
    parser.add_argument(
        "--cp_comm_type",
        choices=CP_COMM_TYPES,
        help="with --cp: ring (p2p) or all-to-all (a2a) (default: MTK_CP_COMM_TYPE, else p2p)",
    )
    add_safety_arguments(parser, can_skip_steps=False)  # DeepSpeed steps before mtk sees the gradient norm
    add_recompute_argument(parser)
    parser.add_argument(
        "--loss_chunk_tokens",
        type=non_negative_int,
        help="tokens per chunk of the loss that never holds the logits; 0: off (default: MTK_LOSS_CHUNK_TOKENS, "
        "else chunks of at most 256 MiB of fp32 logits)",
    )
    add_lora_arguments(parser)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    if not args.deepspeed_config:
        parser.error("--deepspeed_config is required (e.g. ds_configs/zero2.json)")
    return args


def build_engine(args: argparse.Namespace, parallel: ParallelState) -> tuple[Any, torch.nn.Module, Any]:
    """DeepSpeed's engine over mtk's tensor-parallel model (LoRA on its parallel layers if asked), ZeRO sharding over
    the data-parallel group only (mtk's state is DeepSpeed's mpu); the model and the engine's scheduler with it."""

    def report(line: str) -> None:
        if parallel.rank == 0:
            print(line, flush=True)

    # the JSON's batch fields with --batch_size/--grad_accum: one set of numbers (an override is one line)
    ds_config, _ = deepspeed_config(
        args.deepspeed_config,
        parallel.dp_size,
        micro_batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        layout=dp_layout(parallel.world_size, parallel.tp_size, parallel.pp_size, parallel.cp_size),
        report=report,
    )
    check_precision(ds_config, args.deepspeed_config)  # fp16 where DeepSpeed has none: one line
    check_launcher_config(ds_config, args.deepspeed_config, parallel)  # accelerate's "auto", another "mtk" size
    check_deepspeed_experts(ds_config, parallel, args.deepspeed_config)  # what DeepSpeed's MoE path cannot take
    optimizer_and_schedule(ds_config, args.deepspeed_config, args.lr, report)  # --lr beats the JSON's, in one line
    lora = lora_config(args)
    dtype = base_dtype(args) if lora else None
    set_seed(args.seed)
    # a directory: this rank's slices, converted; a built-in config: the same weights at any layout
    settings = run_settings(args)
    model = starting_model(args.model, parallel, settings, seed=args.seed, dtype=dtype)
    if parallelized(model) is None:
        model = parallelize(model, parallel, loss_chunk_tokens=settings.loss_chunk_tokens)
    if args.gradient_checkpointing:
        enable_recompute(model, RunSettings(recompute_granularity="full"), parallelized(model).rng)
    if lora:  # PEFT's LoRA on the parallel layers: ZeRO shards only the adapters' optimizer state
        model = get_peft_model(model, lora, report=print if parallel.rank == 0 else lambda line: None)
    if parallel.cp_size > 1:  # each batch split over CP; ZeRO 0-2 sum the CP ranks' gradients, ZeRO-3 averages them
        average = not sums_over_context_parallel(ds_config)
        attach_context_parallel(hf_model(model), parallel.cp_group, settings.cp_comm_type, average=average)

    def lr_schedule(optimizer):  # DeepSpeed steps it once per optimizer step
        return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_linear(args.warmup_steps, args.max_steps))

    remove_shm_buffers_at_exit()  # DeepSpeed's CPU shared-memory buffers outlive the job otherwise
    trained = [p for p in model.parameters() if p.requires_grad]  # all, or the adapters
    # EP: the spread experts as DeepSpeed's MoE parameters, in param groups of their own (docs/moe.md)
    spread = prepare_experts_for_deepspeed(model, parallel) is not None
    with (
        initialization_cleanup(args.deepspeed_config),  # a failure removes them now; bad config: one line
        spread_experts_seen_as_moe() if spread else contextlib.nullcontext(),
    ):
        partition_over_replicas(model, ds_config, parallel)  # ZeRO-3 at CP > 1: over DP x CP, as it reduces
        engine, _, _, scheduler = deepspeed.initialize(
            model=model,
            model_parameters=named_param_groups(trained) if spread else trained,
            lr_scheduler=lr_schedule,
            config=ds_config,
            mpu=parallel,
        )
    clip_where_deepspeed_keeps_no_norm(engine, parallel)  # ZeRO-0 fp32 keeps no norm to log and check
    return engine, model, scheduler


def build_data(
    args: argparse.Namespace, parallel: ParallelState, tokenizer: Any, micro: int, accum: int
) -> tuple[RunData, DistributedSampler, DataLoader]:
    """The training rows (and evaluation batches), the sampler that gives each DP replica its share (all TP ranks
    of one replica read the same samples) and the loader of ``micro``-row batches."""
    if args.eval_every and not args.eval_data:
        raise DataError("--eval_every needs --eval_data (the rows to evaluate on)")
    data = load_run_data(
        args.data,
        args.eval_data,
        tokenizer,
        args.seq_len,
        parallel,
        batch_size=micro,
        packing=args.packing,
        loss_on=args.loss_on,
        report=lambda line: print(line, flush=True) if parallel.rank == 0 else None,
    )
    sampler = DistributedSampler(
        data.train, num_replicas=parallel.dp_size, rank=parallel.dp_rank, shuffle=True, seed=args.seed, drop_last=True
    )
    loader = DataLoader(data.train, batch_size=micro, sampler=sampler, drop_last=True, collate_fn=data.collate)
    per_epoch = len(loader) // accum * accum  # whole optimizer steps: a step's token count spans its micro-batches
    if per_epoch == 0:
        raise DataError(
            f"--data {args.data} gives {len(data.train)} examples, fewer than one step of {micro} x {accum} "
            f"micro-batches x dp {parallel.dp_size}; give more data or a smaller batch"
        )
    return data, sampler, loader


def main(argv=None) -> None:
    args = parse_args(argv)
    standalone_environment(lambda line: print(line, flush=True))  # plain `python run.py`: one process
    # torch.distributed from the launcher; --tp beats the env
    sizes = {"tp_size": args.tp, "cp_size": args.cp, "ep_size": args.ep, "etp_size": args.etp}
    explicit = {field: size for field, size in sizes.items() if size is not None}
    parallel = ParallelState.from_env(timeout=collective_timeout(args), **explicit)
    where = placement(parallel)  # which node each rank is on; TP groups inside nodes
    if parallel.rank == 0:
        print(where.describe(), flush=True)
    config = resolve_config(args.model)
    check_tp_size(config, parallel.tp_size)
    check_seq_len(config, args.seq_len)
    engine, model, scheduler = build_engine(args, parallel)
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    tokenizer = tokenizer_for(args.model, args.tokenizer, model.config.vocab_size)
    data, sampler, loader = build_data(args, parallel, tokenizer, micro, accum)
    resume = start_point(args, main_process=parallel.rank == 0, barrier=dist.barrier)
    writers = [functools.partial(write_generation_config, engine.module)]  # what `mtk export` ships with the weights
    if Path(args.model).is_dir() or args.tokenizer:
        writers.append(functools.partial(write_tokenizer, tokenizer))

    def position(micro_batches: int) -> dict:
        """What a checkpoint records of the data: where the stream is, and what decides the stream."""
        return {**data_position(micro_batches, micro * parallel.dp_size), "resume_guard": guard.state_dict()}

    # a resumed run must continue the same data stream: a changed one of these is one clear line
    guard = ResumeGuard.from_args(args, data.format)
    step, micro_batches = 0, 0
    if resume:
        meta = load_deepspeed_checkpoint(resume, engine, parallel)
        step, micro_batches = meta.step, rescaled_position(meta.data, micro * parallel.dp_size)
        guard.load_state_dict(meta.data.get("resume_guard", {}))
    if step >= args.max_steps:  # e.g. a requeued job whose last run finished
        if parallel.rank == 0:
            print(f"mtk: {resume} is at step {step}, --max_steps is {args.max_steps}: nothing left to do", flush=True)
        return
    writer = SummaryWriter(str(Path(args.output_dir) / "runs")) if parallel.rank == 0 else None
    global_batch = micro * accum * parallel.dp_size
    if parallel.rank == 0:
        print(
            f"mtk+deepspeed: zero stage {engine.zero_optimization_stage()}, "
            f"tp={parallel.tp_size}{f' cp={parallel.cp_size}' if parallel.cp_size > 1 else ''} dp={parallel.dp_size}"
            f"{f' ep={parallel.ep_size}' if parallel.ep_size > 1 else ''}"
            f"{f' etp={parallel.etp_size}' if parallel.etp_size != parallel.tp_size else ''}, "
            f"global batch {global_batch} "
            f"{'rows' if args.packing else 'examples'}, "
            f"steps {step}->{args.max_steps}",
            flush=True,
        )

    # SIGTERM/SIGINT: save at the next step boundary and exit (a second one: stop at once)
    exit_signal = ExitSignal(engine.device)

    def log(scores: dict[str, float], at_step: int) -> None:
        for name, value in scores.items():
            if writer is not None:
                writer.add_scalar(name, value, at_step)

    evaluation = Evaluation(
        engine,
        data.evaluation,
        engine.device,
        lambda t: all_reduce(t, parallel.dp_group),
        exit_signal,
        log=log,
        main_process=parallel.rank == 0,
        every=args.eval_every,
    )
    boundary = StepBoundary(
        lambda path: save_deepspeed_checkpoint(path, engine, parallel, position(micro_batches), writers=writers),
        args.output_dir,
        args.save_every,
        args.max_steps,
        evaluation,
        exit_signal,
        report=lambda line: print(line, flush=True) if parallel.rank == 0 else None,
        saved_step=step,
    )
    if not boundary.begin():  # a fresh run evaluates its starting point; a signal during it: nothing to save
        if writer is not None:
            writer.close()
        return
    loss_sum, tic = torch.zeros(1), time.perf_counter()

    def sum_over_dp(count: torch.Tensor) -> torch.Tensor:
        return all_reduce(count.to(engine.device), parallel.dp_group)

    # One optimizer step's micro-batches at a time: each micro-batch's loss is its summed token losses
    # / (labelled tokens of the global batch / (accum x dp)); DeepSpeed divides by accum and averages
    # over DP, so the step's gradient is that of the mean over every labelled token of the global batch.
    windows = step_windows(loader, accum, micro_batches, sum_over_dp, parallel.dp_size, set_epoch=sampler.set_epoch)
    for window in windows:
        for batch, _ in window.micro_batches():  # DeepSpeed's engine knows where a step ends
            batch = {key: value.to(engine.device) for key, value in batch.items()}
            loss = engine(**batch, num_items_in_batch=window.num_items, use_cache=False).loss
            engine.backward(loss)
            engine.step()
            micro_batches += 1
            loss_sum += loss.detach().float().cpu()
        step += 1
        mean = all_reduce(loss_sum / accum, parallel.dp_group) / parallel.dp_size  # over micro-batches and DP
        # DeepSpeed has stepped already (it cannot skip a step in fp32): stop before anything is saved
        grad_norm = engine.get_global_grad_norm()  # global over the job; None when DeepSpeed computed none
        for what, value in (("the loss", mean), ("the gradient norm", grad_norm)):
            if value is not None:
                check_finite(value, step, what=what, remedy="lower --lr")
        elapsed, tic = time.perf_counter() - tic, time.perf_counter()
        if writer is not None:
            lr = scheduler.get_last_lr()[0]
            log(step_metrics(window, mean.item(), lr, grad_norm, elapsed, parallel.dp_size), step)
            print(f"step {step} loss {mean.item()!r}", flush=True)
        loss_sum.zero_()
        if boundary.after(step):  # evaluation when due, a signal agreed over the ranks, step_N saved
            break
    boundary.finish(step)
    if writer is not None:
        held = held_elements(engine)  # ZeRO's sharding, as counted: ~1/(tp x dp) of the parameters at stage 3
        print(
            f"mtk: model state held by rank 0: {held['parameters']} parameter elements, "
            f"{held['optimizer_state']} optimizer-state elements",
            flush=True,
        )
        writer.close()
    dist.barrier()


if __name__ == "__main__":
    run_main(main, "run.py")
