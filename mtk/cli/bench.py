"""``mtk bench``: time a training step of a layout, count its collectives, and compare it with its peers."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from mtk.args import non_negative_int
from mtk.bench.contenders import CONTENDERS, BenchSpec
from mtk.bench.plan_check import check_lines, check_ranks
from mtk.bench.report import check_json_target, format_report, report_dict, write_json
from mtk.bench.runner import predicted_for, run_bench
from mtk.checkpoint.export import check_writable_beside
from mtk.config import PIPELINE_SCHEDULES, RECOMPUTE_GRANULARITIES, check_expert_tp_size, check_schedule
from mtk.errors import ConfigError, MtkError
from mtk.models import DTYPES, causal_lm_refusal, check_seq_len, num_layers, resolve_config
from mtk.parallel.layout import Layout
from mtk.parallel.state import default_device
from mtk.pipeline.balance import stage_layer_counts
from mtk.planner.shapes import expert_parallel_refusal, moe_layers
from mtk.rules import check_tp_size

PEERS = ["hf-1thread", "hf-all-threads", "transformers-tp_plan", "deepspeed-autotp"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "bench",
        help="time a training step of a TP/PP layout, next to plain HF, transformers tp_plan and DeepSpeed AutoTP",
        description=(
            "Launch the processes of a layout, run forward+backward+AdamW steps on the same model and batch, and "
            "print the median and min step time, tokens/s, peak memory per rank (RSS on CPU, max allocated on "
            "CUDA) and the collectives per step next to the count the math predicts. --compare also runs plain "
            "HF (1 thread and all threads), transformers' tp_plan and DeepSpeed AutoTP at the same TP, "
            "interleaved, and prints mtk's step time as a ratio to each."
        ),
    )
    parser.add_argument("--model", default="bench-llama", help="built-in config name or local HF directory")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default 2)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    parser.add_argument("--micro_batches", type=int, help="pipeline micro-batches per step (default: the batch)")
    parser.add_argument(
        "--pipeline_layers",
        help="decoder layers per stage (per model chunk with --virtual_stages), e.g. 3,1 (default: even with the "
        "LM head counted as layers of the last stage; needs --pp > 1)",
    )
    parser.add_argument(
        "--pipeline_schedule", choices=PIPELINE_SCHEDULES, default="1f1b", help="with --pp > 1 (default 1f1b)"
    )
    parser.add_argument(
        "--virtual_stages", type=int, default=1, help="model chunks per rank, for --pipeline_schedule interleaved"
    )
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    parser.add_argument("--seq", type=int, default=256, help="sequence length (default 256)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round (default 5)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3 with --compare, else 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="parameter and compute dtype")
    parser.add_argument("--compare", action="store_true", help="also run plain HF, tp_plan and DeepSpeed AutoTP")
    parser.add_argument(
        "--sequence_parallel", action="store_true", help="mtk with Megatron's sequence parallelism (needs --tp > 1)"
    )
    parser.add_argument(
        "--recompute", choices=RECOMPUTE_GRANULARITIES, help="mtk with activation recomputation of every block"
    )
    parser.add_argument("--dp", type=int, default=1, help="mtk's data-parallel replicas, --pp 1 only (default 1)")
    parser.add_argument(
        "--distributed_optimizer", action="store_true", help="mtk with AdamW state sharded over DP (needs --dp > 1)"
    )
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="mtk with FSDP2 over DP: weights, gradients and AdamW state sharded (needs --dp > 1)",
    )
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        help="mtk's expert parallelism: each MoE layer's experts spread over this many of the --dp replicas (a "
        "divisor of --dp); also runs mtk at EP 1 on the same replicas (and, with --compare, DeepSpeed AutoEP) "
        "(default 1)",
    )
    parser.add_argument(
        "--etp",
        type=int,
        help="the experts' TP size: --tp (default: each expert split over TP) or 1 (every expert whole on each TP "
        "rank, each rank running its share of the tokens); 1 also runs mtk with the experts split on the same layout",
    )
    parser.add_argument(
        "--cp",
        type=int,
        default=1,
        help="mtk's context parallelism: the sequence split over this many ranks per TP rank (default 1)",
    )
    parser.add_argument(
        "--cp_comm_type",
        choices=("p2p", "a2a"),
        default="p2p",
        help="with --cp > 1: ring attention (p2p, default) or all-to-all (a2a: the heads per TP rank split over CP)",
    )
    parser.add_argument(
        "--loss_chunk_tokens",
        type=non_negative_int,
        help="mtk's loss in chunks of this many tokens, no logits held; 0: logits kept (default: chunks of at most "
        "256 MiB of fp32 logits)",
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="one more step counting live bytes per rank (max allocated on CUDA), held against mtk plan's prediction",
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before one launch is stopped")
    parser.add_argument(
        "--fork_workers",
        action="store_true",
        help="CPU only: fork each launch's workers from a process that imported torch once (seconds faster per "
        "launch; the peak RSS column then counts pages shared with it)",
    )
    parser.set_defaults(run=run)


def spec_from_args(args: argparse.Namespace) -> BenchSpec:
    for name in ("tp", "pp", "dp", "cp", "ep", "batch", "seq", "steps", "rounds", "micro_batches", "virtual_stages"):
        value = getattr(args, name)
        if value is not None and value < 1:  # (None: rounds and micro_batches left to their defaults)
            raise MtkError(f"--{name} must be at least 1, got {value}")
    if not args.timeout > 0:  # (NaN fails too)
        raise MtkError(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    if args.fork_workers and torch.accelerator.is_available():
        raise MtkError("--fork_workers starts CPU workers (gloo); this machine has an accelerator: leave it off")
    config = resolve_config(args.model)  # one clear line for an unknown name or a missing directory
    check_tp_size(config, args.tp)
    refusal = causal_lm_refusal(config)
    if refusal:
        raise MtkError(f"--model {args.model}: {refusal}; mtk bench measures causal language models (decoders)")
    check_seq_len(config, args.seq, "--seq")
    if args.json:
        json_path = Path(args.json)
        if json_path.is_symlink() and not json_path.exists() or json_path.is_dir():  # (a loop, a folder)
            raise ConfigError(f"--json {args.json} is not a file mtk bench can write; give a file's path")
        check_writable_beside(json_path)  # before the benchmark, not after it
        check_json_target(json_path)  # a full file system too, or a device that refuses writes (/dev/full)
    Layout(world_size=args.tp * args.cp * args.pp * args.dp, tp_size=args.tp, pp_size=args.pp)
    if args.dp > 1 and args.pp > 1:
        raise MtkError("--dp > 1 runs with --pp 1 (the bench's pipeline contender has one replica)")
    if args.dp > 1 and args.compare and args.tp > 1:
        raise MtkError("--compare with --dp > 1 holds mtk against DeepSpeed ZeRO over the same replicas: use --tp 1")
    if args.distributed_optimizer and args.dp == 1:
        raise MtkError("--distributed_optimizer shards the optimizer over data-parallel replicas: give --dp > 1")
    if args.fsdp and args.dp == 1:
        raise MtkError("--fsdp shards the model over data-parallel replicas: give --dp > 1")
    if args.fsdp and args.distributed_optimizer:
        raise MtkError("--fsdp already shards the optimizer state over DP: drop --distributed_optimizer")
    if args.fsdp and args.compare:
        raise MtkError("--fsdp measures mtk's own layout; --compare holds mtk against its peers without it")
    _check_context_parallel(args, config)
    _check_expert_parallel(args, config)
    _check_expert_tp_size(args, config)
    micro = args.micro_batches or (args.batch if args.pp > 1 else 1)
    if args.memory and args.dtype != "fp32":
        raise MtkError("--memory holds the run against mtk plan, which models bf16 as mixed precision: use fp32")
    if args.sequence_parallel and (args.tp == 1 or args.seq % args.tp):
        raise MtkError(f"--sequence_parallel splits --seq over --tp ranks: needs --tp > 1 dividing --seq {args.seq}")
    if args.batch % micro:
        raise MtkError(f"--batch {args.batch} does not split into --micro_batches {micro}; use a multiple of it")
    if args.pp == 1 and (args.pipeline_schedule != "1f1b" or args.virtual_stages != 1):
        raise MtkError("--pipeline_schedule and --virtual_stages choose how pipeline stages run: give --pp > 1")
    problem = args.pp > 1 and check_schedule(args.pipeline_schedule, args.pp, micro, args.virtual_stages)
    if problem:
        raise MtkError(f"--pipeline_schedule {args.pipeline_schedule}: {problem}")
    layers = _pipeline_layers(args, config)
    return BenchSpec(
        pipeline_layers=layers,
        pipeline_schedule=args.pipeline_schedule,
        virtual_stages=args.virtual_stages,
        model=args.model,
        tp_size=args.tp,
        pp_size=args.pp,
        batch=args.batch,
        seq=args.seq,
        steps=args.steps,
        dtype=args.dtype,
        micro_batches=micro,
        sequence_parallel=args.sequence_parallel,
        recompute=args.recompute,
        dp_size=args.dp,
        distributed_optimizer=args.distributed_optimizer,
        fsdp=args.fsdp,
        loss_chunk_tokens=args.loss_chunk_tokens,
        cp_size=args.cp,
        cp_comm=args.cp_comm_type,
        ep_size=args.ep,
        etp_size=args.etp if args.etp != args.tp else None,
        track_memory=args.memory,
    )


def _check_expert_parallel(args: argparse.Namespace, config) -> None:
    """``--ep``: carved out of ``--dp`` (a divisor of it), on an MoE model, with what the Accelerator runs next to
    EP (one line each)."""
    if args.ep == 1:
        return
    if args.dp % args.ep:
        raise MtkError(f"--ep {args.ep} spreads the experts over data-parallel replicas: give --dp a multiple of it")
    refusal = expert_parallel_refusal(config, args.ep)
    if refusal:
        raise MtkError(f"--ep {args.ep}: {refusal}; use an MoE model and an EP size dividing its experts")
    others = [flag for flag, on in (("--fsdp", args.fsdp), ("--memory", args.memory)) if on]  # (--pp: refused at DP)
    if others:
        raise MtkError(f"--ep {args.ep} is measured against mtk at EP 1, without {', '.join(others)}")
    if args.compare and args.tp > 1:
        raise MtkError(
            f"--ep {args.ep} --compare holds mtk against DeepSpeed AutoEP, whose experts are whole: use --tp 1"
        )


def _check_expert_tp_size(args: argparse.Namespace, config) -> None:
    """``--etp``: the TP size or 1 (at TP 1 the same: every expert whole), on an MoE model (one line otherwise)."""
    if args.etp is None or args.etp == args.tp:
        return
    try:
        check_expert_tp_size(args.etp, args.tp)
    except ConfigError as err:
        raise MtkError(f"--etp {args.etp}: {err}") from None
    if moe_layers(config) == 0:
        raise MtkError(f"--etp 1 keeps an MoE model's experts whole on each TP rank; {args.model} has no experts")
    others = [flag for flag, on in (("--fsdp", args.fsdp), ("--cp > 1", args.cp > 1), ("--compare", args.compare),
              ("--sequence_parallel", args.sequence_parallel)) if on]  # fmt: skip
    if others:
        raise MtkError(f"--etp 1 is measured against mtk with the experts split over TP, without {', '.join(others)}")


def _check_context_parallel(args: argparse.Namespace, config) -> None:
    """``--cp``: one replica of one stage, the mtk contender alone, a sequence that splits into ``2 x cp`` chunks
    (each further split over TP with sequence parallelism), heads that split over CP for ``a2a`` (one line if not)."""
    if args.cp == 1:
        return
    others = [flag for flag, on in (("--pp > 1", args.pp > 1), ("--dp > 1", args.dp > 1), ("--compare", args.compare),
              ("--fsdp", args.fsdp), ("--recompute", args.recompute)) if on]  # fmt: skip
    if others:
        raise MtkError(f"--cp {args.cp} is measured on one replica of one stage, without {', '.join(others)}")
    chunks = 2 * args.cp * (args.tp if args.sequence_parallel else 1)
    if args.seq % chunks:
        raise MtkError(f"--cp {args.cp} cuts --seq into {chunks} equal chunks: use a multiple of {chunks}")
    heads = config.num_attention_heads // args.tp
    if args.cp_comm_type == "a2a" and heads % args.cp:
        raise MtkError(f"--cp_comm_type a2a splits each TP rank's {heads} heads over --cp {args.cp}: use p2p")


def _pipeline_layers(args: argparse.Namespace, config) -> tuple[int, ...]:
    """``--pipeline_layers 3,1``: one positive count per stage (model chunk), summing to the model's layers (one line
    if not)."""
    if not args.pipeline_layers:
        return ()
    if args.pp == 1:
        raise MtkError("--pipeline_layers splits the layers over pipeline stages: give --pp > 1")
    try:
        counts = tuple(int(part) for part in args.pipeline_layers.split(","))
    except ValueError:
        raise MtkError(f"--pipeline_layers {args.pipeline_layers!r} is not a list of counts such as 3,1") from None
    stage_layer_counts(num_layers(config), args.pp * args.virtual_stages, counts)  # one line if no split of them
    return counts


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    contenders = ["mtk"] + (PEERS if args.compare else [])
    if args.compare and spec.pp_size > 1:  # the TP peers have no pipeline; torch's own pipelining is the peer
        contenders = ["mtk", "torch-pipelining", "hf-1thread", "hf-all-threads"]
    if args.compare and spec.dp_size > 1:  # the data-parallel axis: DeepSpeed's ZeRO-1 and -2 over the same replicas
        contenders = ["mtk", "deepspeed-zero1", "deepspeed-zero2"]
    if (
        args.compare and spec.tp_size == spec.pp_size == spec.dp_size == 1
    ):  # TP = 1: mtk's overhead on accelerate's own loop
        contenders = ["mtk", "mtk-accelerator", "accelerate", "hf-1thread", "hf-all-threads"]
    if args.compare and spec.ep_size > 1:  # the expert-parallel axis: DeepSpeed AutoEP over the same replicas
        contenders = ["mtk", "deepspeed-autoep"]
    if spec.pp_size > 1:
        contenders.insert(1, "mtk-one-stage")  # the pipeline's ideal is measured from it
    if spec.dp_size > 1:
        contenders.insert(1, "mtk-one-replica")  # and data parallelism's
    if spec.ep_size > 1:
        contenders.insert(1, "mtk-without-ep")  # expert parallelism's baseline: every expert on every replica
    if spec.etp_size == 1:
        contenders.insert(1, "mtk-experts-split")  # the experts' TP size 1's baseline: each expert split over TP
    rounds = args.rounds or (3 if args.compare else 1)
    assert set(contenders) <= set(CONTENDERS)
    print(
        f"mtk bench: {spec.model} tp={spec.tp_size} pp={spec.pp_size}"
        + (f" cp={spec.cp_size} ({spec.cp_comm})" if spec.cp_size > 1 else "")
        + (f" dp={spec.dp_size} ep={spec.ep_size}" if spec.ep_size > 1 else "")
        + (" etp=1" if spec.etp_size == 1 else "")
        + f", {', '.join(contenders)}, {rounds} round(s)",
        flush=True,
    )
    summaries, busy = run_bench(
        spec,
        contenders,
        rounds,
        progress=lambda line: print(line, flush=True),
        timeout=args.timeout,
        fork_workers=args.fork_workers,
    )
    report = report_dict(spec, summaries, predicted_for(spec), busy)
    print(format_report(report))
    ours = next(s for s in summaries if s.name == "mtk")
    if args.memory and ours.error is None:
        checks = check_ranks(spec, ours, default_device().type)
        print("peak memory per rank (mtk), measured vs mtk plan:")
        print("\n".join(check_lines(checks)))
        report["planned_memory_per_rank"] = [
            {"rank": c.rank, "stage": c.stage, "planned": c.predicted.as_dict(), "measured_peak": c.measured_peak}
            for c in checks
        ]
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    return 0 if all(s.error is None for s in summaries if s.name == "mtk") else 1
