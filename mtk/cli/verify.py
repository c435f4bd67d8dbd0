"""``mtk verify``: convert a model at TP=N in N local processes and compare it with the original."""

from __future__ import annotations

import argparse
from datetime import date
from pathlib import Path

import transformers

from mtk.args import positive_float, positive_int, seed
from mtk.config import check_expert_tp_size
from mtk.errors import MtkError, allocation_failure
from mtk.models import auto_class_for, check_seq_len, resolve_config
from mtk.planner.shapes import expert_parallel_refusal
from mtk.rules import check_tp_size
from mtk.spawn import DistributedTestError, run_distributed
from mtk.verify import VERIFY_DTYPES, verify_worker
from mtk.verify.sweep import SweepRow, causal_lm_types, sweep_worker, tp_plan_types

# what a run past this machine's memory can change
_SMALLER = "use a smaller --batch or --seq (every process runs the whole batch, through the model and its reference)"

# fp32: mtk and HF are each about HF's rounding error away from the fp64 truth, in their own directions
ROUNDING_FACTOR = 2.0
DEFAULT_TOLERANCE = {"fp64": 1e-10, "fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-2}


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "verify",
        help="check a tensor-parallel conversion against the unconverted model",
        description=(
            "Spawn N CPU processes (gloo), convert the model to TP=N, run one forward and backward on a "
            "random batch and print the max relative error of the logits, the loss and the gradients. "
            "Exit 0 only if all are within the tolerance."
        ),
    )
    parser.add_argument("--model", help="built-in config name (e.g. tiny-llama) or local HF directory")
    parser.add_argument(
        "--all",
        action="store_true",
        help="every causal LM of the installed transformers with a base_model_tp_plan, tiny and random",
    )
    parser.add_argument("--types", help="with --all: comma-separated model types instead of every one")
    parser.add_argument("--write", help="with --all: replace the sweep table in this markdown file")
    parser.add_argument(
        "--pp",
        type=positive_int,
        default=1,
        help="with --all: pipeline stages (the models run by 1F1B; processes: tp x pp)",
    )
    parser.add_argument(
        "--tp", type=positive_int, default=2, help="tensor-parallel degree = number of processes (default 2)"
    )
    parser.add_argument(
        "--ep",
        type=positive_int,
        default=1,
        help="an MoE model's experts spread over this many data-parallel replicas, each on the same batch "
        "(processes: tp x ep; default 1)",
    )
    parser.add_argument(
        "--etp",
        type=positive_int,
        help="the experts' TP size: the TP size (default: each expert split over TP) or 1 (every expert whole on "
        "each TP rank, which runs them on its share of the tokens)",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(VERIFY_DTYPES),
        default="fp32",
        help="compute dtype (default fp32); fp64 tells rounding from bugs: any gap above ~1e-10 is a bug",
    )
    parser.add_argument(
        "--tolerance", type=positive_float, help="max relative error (default 1e-10 fp64, 1e-5 fp32, 2e-2 bf16/fp16)"
    )
    parser.add_argument("--batch", type=positive_int, default=2, help="batch size (default 2)")
    parser.add_argument("--seq", type=positive_int, default=16, help="sequence length (default 16)")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the weights (built-in configs) and the batch")
    parser.add_argument("--timeout", type=positive_float, default=600, help="seconds before the processes are stopped")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.all:
        # the sweep builds its own tiny models and batches: these options would change nothing there
        fixed = [
            f"--{k}"
            for k, default in (("model", None), ("batch", 2), ("seq", 16), ("seed", 0), ("ep", 1), ("etp", None))
            if getattr(args, k) != default
        ]
        if fixed:
            raise MtkError(f"{', '.join(fixed)} cannot go with --all (the sweep builds tiny models and batches)")
        return run_all(args)
    if not args.model:
        raise MtkError("mtk verify needs --model NAME_OR_DIR, or --all for the architecture sweep")
    if args.types or args.write or args.pp != 1:
        raise MtkError("--types, --write and --pp go with --all")
    refusal = expert_parallel_refusal(resolve_config(args.model), args.ep) if args.ep > 1 else None
    if refusal:
        raise MtkError(f"--ep {args.ep}: {refusal}; use --ep 1 or a divisor of the experts")
    # Fail fast, in one line, before any process starts: unknown name, missing directory, bad tp.
    check_tp_size(resolve_config(args.model), args.tp)
    check_seq_len(resolve_config(args.model), args.seq, "--seq")  # (GPT-2 failed in every worker's forward)
    if args.seq < 2 and auto_class_for(resolve_config(args.model)) is transformers.AutoModelForCausalLM:  # (NaN)
        raise MtkError("--seq 1: a causal LM's row of one token has no next token to predict (no loss); use 2 or more")
    check_expert_tp_size(args.etp, args.tp)
    tolerance = args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE[args.dtype]
    layout = f"tp={args.tp}" + (f" ep={args.ep}" if args.ep > 1 else "") + (f" etp={args.etp}" if args.etp else "")
    print(f"mtk verify: {args.model} at {layout}, {args.dtype}, batch {args.batch} x seq {args.seq}", flush=True)
    rounding = args.dtype == "fp32" and args.tolerance is None  # judged against HF's own fp32 rounding
    try:
        results = run_distributed(
            verify_worker,
            world_size=args.tp * args.ep,
            args=(args.model, args.dtype, args.batch, args.seq, args.seed, rounding, args.ep, args.etp),
            timeout=args.timeout,
        )
    except DistributedTestError as err:  # a worker's allocation past memory is the sizes asked for: one line
        one_line = allocation_failure(err, _SMALLER) or next(
            (error for error in err.errors.values() if isinstance(error, MtkError)), None
        )  # (a process group that could not form: the environment's, in one line)
        if one_line is None:
            raise  # a bug: the workers' tracebacks are wanted
        raise one_line from None
    errors = {r.error for r in results if r.error}
    if errors:
        raise MtkError(errors.pop())
    worst = max(results, key=lambda r: r.grads)
    floor = results[0].rounding or {}
    rows = [
        ("logits", max(r.logits for r in results), ""),
        ("loss", max(r.loss for r in results), ""),
        ("gradients", worst.grads, f"({worst.num_params} parameters; worst: {worst.worst_param})"),
    ]
    print(f"  model {worst.model_class}, rules: {worst.rule_set}")
    passed = True
    for name, error, note in rows:
        bar = max(tolerance, ROUNDING_FACTOR * floor[name]) if name in floor else tolerance
        passed &= error <= bar
        own = f" HF fp32 vs fp64 {floor[name]:.2e}, bar {bar:.1e}" if name in floor else ""
        print(f"  {name:<10} max rel error {error:.2e}  {'ok' if error <= bar else 'FAIL'} {own} {note}".rstrip())
    how = f" or {ROUNDING_FACTOR:g}x HF's own fp32 rounding" if floor else ""
    print(f"{'PASS' if passed else 'FAIL'} (tolerance {tolerance:.0e}{how})")
    return 0 if passed else 1


TABLE_START, TABLE_END = "<!-- verify-all:start -->", "<!-- verify-all:end -->"


def _table(rows: list[SweepRow], args: argparse.Namespace, tolerance: float) -> str:
    exact = sum(r.status == "exact" for r in rows)
    swept = sum(r.status != "not swept" for r in rows)
    pp = (f" --pp {args.pp}" if args.pp > 1 else "") + (" --dtype fp64" if args.dtype == "fp64" else "")
    lines = [
        f"`mtk verify --all --tp {args.tp}{pp}` on {date.today().isoformat()}, "
        f"transformers {transformers.__version__}: "
        f"{exact} of {swept} causal LMs exact ({args.dtype}, tolerance {tolerance:.0e}); "
        f"{len(rows)} model types with a base_model_tp_plan in all.",
        "",
        "| model type | status | rules | logits | loss | gradients | note |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        numbers = [f"{x:.1e}" if x == x else "" for x in (r.logits, r.loss, r.grads)]
        note = r.reason.replace("|", "/") if r.status != "exact" else ""
        lines.append(f"| {r.model_type} | {r.status} | {r.source} | {' | '.join(numbers)} | {note} |")
    return "\n".join(lines)


def run_all(args: argparse.Namespace) -> int:
    types = [t.strip() for t in args.types.split(",")] if args.types else causal_lm_types()
    unknown = sorted(set(types) - set(causal_lm_types()))
    if unknown:
        raise MtkError(f"--types {','.join(unknown)}: not a causal LM with a base_model_tp_plan here")
    if args.dtype not in ("fp32", "fp64") or (args.dtype == "fp64" and args.pp > 1):
        raise MtkError(f"--all runs in fp32 or fp64 (fp64 with --pp 1), not --dtype {args.dtype}")
    tolerance = args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE[args.dtype]
    if args.pp < 1:
        raise MtkError(f"--pp must be at least 1, got {args.pp}")
    document = _table_document(args.write) if args.write else None  # (checked before the sweep's hours)
    print(f"mtk verify --all: {len(types)} architectures at tp={args.tp} pp={args.pp}, {args.dtype}", flush=True)
    world = args.tp * args.pp
    sweep = (types, tolerance, args.pp, args.dtype)
    try:
        rows = run_distributed(sweep_worker, world_size=world, args=sweep, timeout=args.timeout)[0]
    except DistributedTestError as err:  # a sweep that outlives --timeout (or a crashed worker): one line
        raise MtkError(
            f"the sweep did not finish: {str(err).splitlines()[0]}; raise --timeout or pass --types"
        ) from None
    if not args.types:  # the table names every architecture with a tp plan; encoders, vision, audio: not swept
        causal = set(types)
        rows += [
            SweepRow(t, "not swept", reason="no causal-LM class (encoder, vision or audio model)")
            for t in tp_plan_types()
            if t not in causal
        ]
        rows.sort(key=lambda row: row.model_type)
    table = _table(rows, args, tolerance)
    print(table)
    if document is not None:
        path, text = _table_document(str(document[0]))  # (again: the file may have been edited during the sweep)
        head, rest = text.split(TABLE_START, 1)
        try:
            path.write_text(head + TABLE_START + "\n" + table + "\n" + TABLE_END + rest.split(TABLE_END, 1)[1])
        except OSError as err:
            raise MtkError(f"--write {path}: {err.strerror or err}; the table is printed above") from None
    return 0 if all(r.status != "differs" for r in rows) else 1


def _table_document(given: str) -> tuple[Path, str]:
    """The markdown file ``--write`` names and its text, checked before the sweep runs (it takes hours with every
    architecture): a file that cannot be read as text, or holds no table block to replace, is one line."""
    path = Path(given)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise MtkError(f"--write {path}: cannot be read as a markdown file ({reason})") from None
    if TABLE_START not in text or TABLE_END not in text:
        raise MtkError(f"--write {path}: no {TABLE_START} ... {TABLE_END} block to replace")
    return path, text
