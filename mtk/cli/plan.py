"""``mtk plan``: which TP x PP x DP layout, ZeRO stage / distributed optimizer, SP and recompute fit a model
on a cluster, with per-rank memory, communication and a roofline step time for each (docs/plan.md)."""

from __future__ import annotations

import argparse
import json
import math

from mtk.args import positive_int
from mtk.config import CP_COMM_TYPES
from mtk.errors import ConfigError, MtkError
from mtk.models import check_seq_len, num_layers, resolve_config
from mtk.parallel.router_loss import router_loss_refusal
from mtk.planner.cluster import INFINIBAND_GBPS, NVLINK_GBPS, PEAK_TFLOPS, Cluster, parse_bytes
from mtk.planner.search import Estimate, Request, context_parallel_refusal, plan, valid_tp_sizes
from mtk.planner.shapes import expert_parallel_refusal, moe_layers
from mtk.planner.timing import model_size
from mtk.rules import check_tp_size

LARGEST_CLUSTER = 1 << 20  # 1,048,576 GPUs
LARGEST_BATCH = 1 << 16  # 65,536 sequences a step (a pretraining batch of 4M tokens is ~1,000 sequences)
ENGINES = {"any": ("accelerate", "deepspeed"), "accelerate": ("accelerate",), "deepspeed": ("deepspeed",)}
GIB = 2**30


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "plan",
        help="rank the TP/PP/DP/ZeRO/SP/recompute layouts that fit a model on a cluster (no weights needed)",
        description=(
            "Enumerate the layouts mtk can run (TP dividing the heads and inside a node, PP dividing the layers, "
            "DP dividing the global batch; accelerate with or without the distributed optimizer, DeepSpeed ZeRO "
            "1/2/3; SP; selective or full recompute; micro-batch sizes), predict each one's per-rank memory by "
            "running mtk's conversion on the meta device, its communication per step and a roofline step time, and "
            "print those that fit, fastest first. Only the model's config is read."
        ),
    )
    parser.add_argument("--model", required=True, help="built-in name, HF directory or config.json file")
    parser.add_argument("--gpus", type=positive_int, required=True, help="GPUs in all")
    parser.add_argument("--nodes", type=positive_int, default=1, help="machines the GPUs are spread over (default 1)")
    parser.add_argument("--gpu_memory", type=_memory_size, default=80 * GIB, help="memory per GPU (default 80GiB)")
    parser.add_argument(
        "--reserve", type=_memory_size, default=2 * GIB, help="per GPU, not for tensors: CUDA context, NCCL (2GiB)"
    )
    parser.add_argument("--seq_len", type=positive_int, required=True, help="tokens per sequence")
    parser.add_argument("--global_batch", type=positive_int, required=True, help="sequences per optimizer step")
    parser.add_argument("--dtype", choices=sorted(PEAK_TFLOPS), default="bf16", help="training precision (bf16)")
    parser.add_argument("--lora_r", type=positive_int, help="LoRA rank on every linear mtk splits (frozen base)")
    parser.add_argument(
        "--lora_target_parameters",
        help="with --lora_r: comma-separated tensors adapted too (PEFT's target_parameters), e.g. an MoE's "
        "mlp.experts.gate_up_proj,mlp.experts.down_proj",
    )
    parser.add_argument("--engine", choices=sorted(ENGINES), default="any", help="accelerate, deepspeed or any")
    parser.add_argument("--offload", action="store_true", help="also consider DeepSpeed's optimizer offload to CPU")
    parser.add_argument("--tp", type=positive_int, help="only this tensor-parallel degree")
    parser.add_argument("--pp", type=positive_int, help="only this number of pipeline stages")
    parser.add_argument(
        "--cp",
        type=_degrees,
        default=(1,),
        help="context-parallel degree to weigh (each sequence split over N ranks), or 'auto' for every one the GPUs "
        "and --seq_len allow (default 1)",
    )
    parser.add_argument(
        "--ep",
        type=_degrees,
        default=(1,),
        help="expert-parallel degree to weigh on an MoE model (each MoE layer's experts spread over N data-parallel "
        "replicas), or 'auto' for every one the GPUs allow (default 1)",
    )
    parser.add_argument(
        "--etp",
        choices=("tp", "1", "auto"),
        default="tp",
        help="the experts' TP size to weigh on an MoE model: tp (each expert split over the TP ranks, default), 1 "
        "(every expert whole on each TP rank, each rank running its share of the tokens), or auto (both)",
    )
    parser.add_argument(
        "--cp_comm_type",
        choices=CP_COMM_TYPES,
        default="p2p",
        help="with --cp: ring (p2p, default) or all-to-all (a2a)",
    )
    parser.add_argument("--peak_tflops", type=float, help="per GPU (default: H100 SXM, 989 bf16 / 67 fp32)")
    parser.add_argument("--intra_node_gbps", type=float, default=NVLINK_GBPS, help="GB/s per GPU inside a node (450)")
    parser.add_argument("--inter_node_gbps", type=float, default=INFINIBAND_GBPS, help="GB/s per GPU between (50)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="whose attention kernels (cuda)")
    parser.add_argument("--top", type=positive_int, default=10, help="rows to print (default 10)")
    parser.add_argument("--all", action="store_true", help="every SP/recompute setting, fitting or not")
    parser.add_argument("--json", action="store_true", help="print every estimate as JSON instead of the table")
    parser.set_defaults(run=run)


_EXPERT_TP_SIZES: dict[str, tuple[int | None, ...]] = {"tp": (None,), "1": (1,), "auto": (None, 1)}


def _degrees(text: str) -> tuple:
    """``--cp`` / ``--ep``: one degree, or ``auto``."""
    if text == "auto":
        return ("auto",)
    if not text.isdecimal() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer or 'auto'")
    return (int(text),)


def _target_parameters(args: argparse.Namespace) -> tuple[str, ...]:
    """``--lora_target_parameters`` as names (one line without ``--lora_r``, as the training scripts say it)."""
    if not args.lora_target_parameters:
        return ()
    if not args.lora_r:
        raise ConfigError("--lora_target_parameters configures LoRA adapters; add --lora_r R to plan for them")
    return tuple(t.strip() for t in args.lora_target_parameters.split(",") if t.strip())


def _memory_size(text: str) -> int:
    if text.strip().replace(".", "", 1).isdigit() and float(text) != 0:  # (80 meant 80 GB, read as 80 bytes)
        number = text.strip()
        raise argparse.ArgumentTypeError(f"{text!r} has no unit; give one, such as {number}GiB or {number}GB")
    try:
        return parse_bytes(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def request_from_args(args: argparse.Namespace) -> Request:
    config = resolve_config(args.model)
    check_seq_len(config, args.seq_len)
    for name in ("peak_tflops", "intra_node_gbps", "inter_node_gbps"):
        value = getattr(args, name)
        if value is not None and not 0 < value < math.inf:  # (inf: every step 0 s long)
            raise ConfigError(f"--{name} must be a positive finite number, got {value}")
    if args.gpus > LARGEST_CLUSTER:  # every layout's degrees are searched (and --cp/--ep auto lists each size)
        raise ConfigError(f"--gpus {args.gpus}: mtk plan weighs clusters of up to {LARGEST_CLUSTER} GPUs")
    if args.global_batch > LARGEST_BATCH:  # each schedule is walked micro-batch by micro-batch
        raise ConfigError(
            f"--global_batch {args.global_batch}: mtk plan weighs up to {LARGEST_BATCH} sequences a step"
        )
    cluster = Cluster(
        gpus=args.gpus,
        nodes=args.nodes,
        gpu_memory=args.gpu_memory,
        peak_flops=(args.peak_tflops or PEAK_TFLOPS[args.dtype]) * 1e12,
        intra_node_bandwidth=args.intra_node_gbps * 1e9,
        inter_node_bandwidth=args.inter_node_gbps * 1e9,
    )
    if args.reserve >= args.gpu_memory:
        raise ConfigError(f"--reserve {args.reserve / GIB:.1f} GiB leaves nothing of --gpu_memory for tensors")
    if args.offload and args.engine == "accelerate":
        raise ConfigError("--offload is DeepSpeed's optimizer offload: use --engine deepspeed or any")
    request = Request(
        config=config,
        cluster=cluster,
        seq=args.seq_len,
        global_batch=args.global_batch,
        dtype=args.dtype,
        lora_r=args.lora_r or 0,
        lora_target_parameters=_target_parameters(args),
        engines=ENGINES[args.engine],
        offload=args.offload,
        reserve=args.reserve,
        tp_size=args.tp,
        pp_size=args.pp,
        cp_sizes=args.cp if args.cp != ("auto",) else tuple(range(1, cluster.gpus + 1)),
        cp_comm=args.cp_comm_type,
        ep_sizes=args.ep if args.ep != ("auto",) else tuple(range(1, cluster.gpus + 1)),
        etp_sizes=_EXPERT_TP_SIZES[args.etp],
        device=args.device,
        every_setting=args.all,
    )
    _check_fixed_degrees(request)
    return request


def _check_fixed_degrees(request: Request) -> None:
    """One line for a --tp / --pp the rules refuse, naming the ones they allow."""
    cluster, config = request.cluster, request.config
    if request.tp_size:
        check_tp_size(config, request.tp_size)  # heads: one line naming the valid sizes
        if cluster.gpus_per_node % request.tp_size or request.tp_size > cluster.gpus:
            raise ConfigError(
                f"--tp {request.tp_size} does not fit inside a node of {cluster.gpus_per_node} GPUs (TP "
                f"all-reduces every layer and stays on NVLink); valid here: {valid_tp_sizes(request)}"
            )
    if request.cp_sizes != (1,) and len(request.cp_sizes) == 1:  # one degree asked for: refused in one line
        cp = request.cp_sizes[0]
        refusal = context_parallel_refusal(config)
        if refusal:
            raise ConfigError(f"--cp {cp}: {refusal}")
        if request.seq % (2 * cp) or cluster.gpus % cp:
            raise ConfigError(
                f"--cp {cp} needs --seq_len a multiple of {2 * cp} (each rank takes 2 of {2 * cp} equal chunks) and "
                f"--gpus a multiple of {cp}"
            )
    if request.ep_sizes != (1,) and len(request.ep_sizes) == 1:
        ep = request.ep_sizes[0]
        refusal = expert_parallel_refusal(config, ep)
        if refusal:
            raise ConfigError(f"--ep {ep}: {refusal}; use --ep 1 or a divisor of the experts")
        if cluster.gpus % ep:
            raise ConfigError(f"--ep {ep} spreads the experts over data-parallel replicas: use a divisor of --gpus")
        if "accelerate" not in request.engines and request.lora_r and not request.lora_target_parameters:
            raise ConfigError(
                f"--ep {ep} under DeepSpeed trains the experts or their LoRA factors: with --lora_r add "
                "--lora_target_parameters (the expert tensors), or use --engine accelerate or any"
            )
        if "accelerate" not in request.engines and 1 not in request.cp_sizes:
            raise ConfigError(f"--ep {ep} under DeepSpeed runs without context parallelism: use --cp 1")
    if request.etp_sizes == (1,) and not moe_layers(config):
        raise ConfigError(f"--etp 1 keeps an MoE model's experts whole on each TP rank; {config.model_type} has none")
    if request.pp_size and request.pp_size > 1:
        refusal = router_loss_refusal(config, "pipeline parallelism")
        if refusal:
            raise ConfigError(f"--pp {request.pp_size}: {refusal}")
    if request.pp_size:
        layers = num_layers(config)
        if layers < request.pp_size:  # (an uneven split is the runtime's too: mtk.pipeline.balance)
            raise ConfigError(
                f"--pp {request.pp_size} is more stages than the model's {layers} layers; use at most {layers}"
            )


def _describe(request: Request, lora: str) -> str:
    cluster = request.cluster
    size = model_size(request.config)
    return (
        f"mtk plan: {request.config.model_type}, {size.parameters / 1e9:.2f} B parameters, {lora}, {request.dtype}; "
        f"{cluster.gpus} GPUs ({cluster.nodes} x {cluster.gpus_per_node}, {cluster.gpu_memory / GIB:.0f} GiB each, "
        f"{request.reserve / GIB:.1f} GiB reserved); seq {request.seq}, global batch {request.global_batch}"
    )


def format_table(estimates: list[Estimate], top: int) -> str:
    """The ranked rows; memory and traffic in GiB (MiB when every peak is below 1 GiB)."""
    rows = estimates[:top]
    unit, size = ("GiB", GIB) if max((e.memory.peak for e in rows), default=0) >= GIB else ("MiB", 2**20)
    context = any(e.candidate.cp_size > 1 for e in rows)  # a CP column only where some row splits sequences
    experts = any(e.candidate.ep_size > 1 for e in rows)  # an EP column only where some row spreads experts
    cp_head = (f" {'CP':>6}" if context else "") + (f" {'EP':>6}" if experts else "")
    head = (
        f"{'#':>3}  {'layout':<40} {'engine':<10} {'weights':>7} {'grads':>6} {'optim':>6} {'act':>6} "
        f"{'buffers':>7} {'peak':>6} | {'TP':>7}{cp_head} {'PP':>6} {'DP':>6} | "
        f"{'bubble+':>7} {'step s':>8} {'tokens/s':>9}"
    )
    lines = [f"(memory and traffic in {unit})", head, "-" * len(head)]
    for index, e in enumerate(rows, 1):
        m, t = e.memory, e.traffic
        cp = (f" {t.cp_bytes / size:>6.2f}" if context else "") + (f" {t.ep_bytes / size:>6.2f}" if experts else "")
        lines.append(
            f"{index:>3}  {e.candidate.label:<40} {e.candidate.engine:<10} {m.weights / size:>7.1f} "
            f"{m.gradients / size:>6.1f} {m.optimizer / size:>6.1f} {m.activations / size:>6.1f} "
            f"{m.buffers / size:>7.1f} {m.peak / size:>6.1f} | {t.tp_bytes / size:>7.1f}{cp} "
            f"{t.pp_bytes / size:>6.2f} {t.dp_bytes / size:>6.1f} | "
            f"{e.time.bubble_overhead:>7.2f} {e.time.total:>8.3g} {e.tokens_per_s:>9.0f}" + ("" if e.fits else "  *")
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    request = request_from_args(args)
    estimates = plan(request)
    if not estimates:
        raise MtkError(
            f"no layout of {args.gpus} GPUs divides --global_batch {args.global_batch} into data-parallel replicas "
            f"(and the layers into stages); use a global batch that a power of two divides"
        )
    fitting = [e for e in estimates if e.fits]
    if args.json:
        print(json.dumps({"request": _request_dict(request), "estimates": [e.as_dict() for e in estimates]}))
        return 0 if fitting else 2
    if not fitting and not args.all:
        smallest = min(estimates, key=lambda e: e.memory.peak)
        raise MtkError(
            f"{request.config.model_type} fits no layout of {args.gpus} x {args.gpu_memory / GIB:.0f} GiB: the "
            f"smallest ({smallest.candidate.label}, {smallest.candidate.engine}) needs "
            f"{(smallest.memory.peak + request.reserve) / GIB:.1f} GiB per GPU; add GPUs, train LoRA adapters "
            f"(--lora_r), shorten --seq_len or allow --offload"
        )
    print(_describe(request, f"LoRA r={request.lora_r}" if request.lora_r else "full fine-tuning"))
    shown = estimates if args.all else fitting
    print(
        f"{len(fitting)} of {len(estimates)} layouts fit; fastest first. Memory per rank of the fullest pipeline "
        f"stage, GiB (peak = weights + optim + buffers + the larger of act + gradients live then, gradients + "
        f"reduction); communication per rank and step, GiB; step time from the roofline (docs/plan.md)."
        + ("\n* does not fit" if args.all else "")
    )
    print(format_table(shown, args.top))
    return 0


def _request_dict(request: Request) -> dict:
    cluster = request.cluster
    return {
        "model_type": request.config.model_type,
        "gpus": cluster.gpus,
        "nodes": cluster.nodes,
        "gpu_memory": cluster.gpu_memory,
        "reserve": request.reserve,
        "peak_flops": cluster.peak_flops,
        "intra_node_bandwidth": cluster.intra_node_bandwidth,
        "inter_node_bandwidth": cluster.inter_node_bandwidth,
        "seq_len": request.seq,
        "global_batch": request.global_batch,
        "dtype": request.dtype,
        "lora_r": request.lora_r,
        "engines": list(request.engines),
        "offload": request.offload,
        "cp_sizes": list(request.cp_sizes),
        "ep_sizes": list(request.ep_sizes),
        "etp_sizes": [etp or "tp" for etp in request.etp_sizes],
        "cp_comm_type": request.cp_comm,
        "device": request.device,
    }
