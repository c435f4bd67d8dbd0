"""``mtk export CHECKPOINT OUT``: merge a training checkpoint into an HF model directory (offline)."""

from __future__ import annotations

import argparse

from mtk.checkpoint.adapter_export import export_adapter, export_merged
from mtk.checkpoint.export import export_checkpoint
from mtk.errors import ConfigError
from mtk.models import DTYPES


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "export",
        help="merge a checkpoint (any TP/PP/DP layout) into a HF directory that from_pretrained loads",
        description=(
            "Merge the per-rank shards of CHECKPOINT (e.g. ckpts/step_150) into OUT: config.json, "
            "model.safetensors (or shards + index) with HF's names, no vocabulary padding, and the "
            "tokenizer files if the run saved them. No process group is needed. The result is reloaded "
            "with from_pretrained and compared tensor by tensor unless --no_verify."
        ),
    )
    parser.add_argument("checkpoint", help="checkpoint directory written by save_state, e.g. ckpts/step_150")
    parser.add_argument("out", help="new directory for the HF model")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast floating-point weights (default: as trained)")
    parser.add_argument("--max_shard_size", help="largest safetensors file (default 5GB; not with --adapter)")
    parser.add_argument("--no_verify", action="store_true", help="skip reloading and comparing the result")
    lora = parser.add_mutually_exclusive_group()
    lora.add_argument(
        "--adapter", action="store_true", help="a LoRA checkpoint: write a PEFT adapter directory (PeftModel loads it)"
    )
    lora.add_argument("--merge", action="store_true", help="a LoRA checkpoint: write the base, adapters merged in")
    parser.add_argument("--base", help="with --merge: the base HF directory (default: the one the run loaded)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.base and not args.merge:
        raise ConfigError("--base is the model --merge merges into; add --merge")
    if args.adapter and args.max_shard_size is not None:
        raise ConfigError(
            "--max_shard_size with --adapter: a PEFT adapter directory is one adapter_model.safetensors (PEFT reads "
            "no shards); drop it"
        )
    max_shard_size = args.max_shard_size or "5GB"
    if args.adapter:
        out = export_adapter(args.checkpoint, args.out, dtype=args.dtype, verify=not args.no_verify)
        print(f"mtk export: wrote the PEFT adapter directory {out}")
        return 0
    if args.merge:
        out = export_merged(
            args.checkpoint,
            args.out,
            base=args.base,
            dtype=args.dtype,
            max_shard_size=max_shard_size,
            verify=not args.no_verify,
        )
        print(f"mtk export: wrote {out}, the base with the adapters merged in")
        return 0
    out = export_checkpoint(
        args.checkpoint, args.out, dtype=args.dtype, max_shard_size=max_shard_size, verify=not args.no_verify
    )
    print(f"mtk export: wrote {out}" + ("" if args.no_verify else " (reloaded with from_pretrained and verified)"))
    return 0
