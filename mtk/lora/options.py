"""The ``--lora_*`` and ``--base_dtype`` options of the example scripts, turned into a ``peft.LoraConfig``."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from mtk.args import finite_float, positive_float, positive_int
from mtk.errors import ConfigError
from mtk.models import DTYPES

__all__ = ["add_lora_arguments", "base_dtype", "lora_config"]

_DEPENDENT = ("lora_alpha", "lora_dropout", "lora_targets", "lora_target_parameters")


def _dropout(text: str) -> float:
    value = finite_float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a dropout probability in [0, 1)")
    return value


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA (PEFT adapters on the parallel model; docs/lora.md)")
    group.add_argument("--lora_r", type=positive_int, help="train LoRA adapters of this rank, not the whole model")
    group.add_argument("--lora_alpha", type=positive_float, help="LoRA scaling numerator (default: PEFT's, 8)")
    group.add_argument("--lora_dropout", type=_dropout, help="dropout on the adapters' input (default 0)")
    group.add_argument(
        "--lora_targets",
        help="comma-separated HF module names, e.g. q_proj,k_proj,v_proj,o_proj (default: all-linear)",
    )
    group.add_argument(
        "--lora_target_parameters",
        help="comma-separated HF parameter names to adapt as tensors (PEFT's target_parameters), e.g. an MoE's "
        "mlp.experts.gate_up_proj,mlp.experts.down_proj (any TP and EP size)",
    )
    group.add_argument(
        "--base_dtype",
        choices=sorted(DTYPES),
        help="with --lora_r: keep the frozen base in this dtype (adapters and their optimizer state stay fp32)",
    )


def lora_config(args: argparse.Namespace, task_type: str = "CAUSAL_LM") -> Any:
    """The ``LoraConfig`` the options ask for, or ``None`` without ``--lora_r`` (one line for a stray option)."""
    if args.lora_r is None:
        stray = [f"--{name}" for name in (*_DEPENDENT, "base_dtype") if getattr(args, name) is not None]
        if stray:
            raise ConfigError(f"{', '.join(stray)} configure LoRA adapters; add --lora_r R to train them")
        return None
    from peft import LoraConfig

    targets: Any = args.lora_targets or "all-linear"
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    kwargs: dict[str, Any] = {"r": args.lora_r, "target_modules": targets, "task_type": task_type}
    if args.lora_alpha is not None:
        kwargs["lora_alpha"] = args.lora_alpha
    if args.lora_dropout is not None:
        kwargs["lora_dropout"] = args.lora_dropout
    if args.lora_target_parameters:
        kwargs["target_parameters"] = [t.strip() for t in args.lora_target_parameters.split(",") if t.strip()]
        if kwargs.get("lora_dropout"):
            raise ConfigError(
                "--lora_dropout with --lora_target_parameters: PEFT adapts parameters without dropout; drop one"
            )
    return LoraConfig(**kwargs)


def base_dtype(args: argparse.Namespace) -> torch.dtype:
    """The dtype to build or load the base model in (fp32 unless ``--base_dtype``)."""
    return DTYPES[args.base_dtype] if args.base_dtype else torch.float32
