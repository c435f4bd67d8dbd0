"""Which optimizers update a sharded parameter as they would the whole one.

Under tensor parallelism (and FSDP2) each rank's optimizer sees its shard of a split parameter, as a tensor of its
own. An update that treats every element on its own (SGD, Adam, AdamW, ...: moments per element) is then exactly
the whole tensor's update, cut. One that reads statistics across a tensor is not: Adafactor's factored second moment
(row and column means) and its update's RMS, LAMB's and LARS's trust ratio (the tensor's norm), GaLore's and
Apollo's projections, Shampoo's and Muon's matrix roots and orthogonalizations, L-BFGS's history would each be
the shard's, and training would differ from one process without a word (Adafactor at TP 2: 1e-2 relative on the
weights after three steps). Megatron-Core offers only elementwise optimizers next to TP for this reason.

An optimizer that keeps its state quantized (bitsandbytes' and torchao's 8-bit and 4-bit AdamW, Lion, RMSprop)
scales each block of the flattened tensor by the block's largest value: a shard's blocks hold other elements than
the whole tensor's, so its update differs too, although bitsandbytes names the class ``AdamW``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from mtk.errors import ConfigError

__all__ = ["check_elementwise_update", "check_named_update", "checked_additions"]

# torch's optimizers whose update of an element reads that element's gradient and state alone (and the step count)
ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)
# optimizers (by class name, whichever package defines them) whose update reads a whole tensor
WHOLE_TENSOR = (
    "adafactor", "lbfgs", "sparseadam", "lamb", "lars", "galore", "apollo", "lomo", "shampoo", "muon", "soap",
    "stableadamw", "onebit", "zerooneadam",
)  # fmt: skip
# class names of optimizers whose state is quantized in blocks (bitsandbytes' AdamW8bit, torchao's AdamW4bit, ...)
QUANTIZED_STATE = ("8bit", "4bit", "fp8")


# DeepSpeed's JSON optimizer types (and accelerate's, through it) that update each element on their own
ELEMENTWISE_NAMES = {cls.__name__.lower() for cls in ELEMENTWISE} | {
    "fusedadam", "cpuadam", "deepspeedcpuadam", "lion", "fusedlion", "cpulion", "muadam", "muadamw", "musgd"
}  # fmt: skip


def check_elementwise_update(
    optimizer: torch.optim.Optimizer,
    sharded: Iterable[torch.Tensor],
    report: Callable[[str], None],
    name: str | None = None,
) -> None:
    """Refuse (one line) an optimizer whose update reads a whole tensor when it holds one of ``sharded`` (parameters
    split over TP or FSDP2); report one whose class mtk does not know. Nothing to check when it holds none. ``name``:
    what the optimizer really is where ``optimizer`` stands in for it (accelerate's ``DummyOptim`` for the DeepSpeed
    JSON's ``optimizer.type``)."""
    ids = {id(p) for p in sharded}
    if not any(id(p) in ids for group in optimizer.param_groups for p in group["params"]):
        return
    if name is None and type(optimizer) in ELEMENTWISE:
        return
    if name is None and _quantized_state(optimizer):
        raise ConfigError(
            f"{type(optimizer).__module__}.{type(optimizer).__name__} keeps its state quantized in blocks of each "
            "flattened tensor (8-bit or 4-bit state), and under tensor parallelism (or FSDP2) each rank holds a "
            "shard of some: its blocks hold other elements than one process's, and it would train differently. Use "
            "a 32-bit optimizer (TrainingArguments --optim adamw_torch), or TP 1 without FSDP2"
        )
    check_named_update(name or type(optimizer).__name__, report)


def _quantized_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` keeps quantized state: a low-bit class name, or bitsandbytes' ``optim_bits`` below 32
    (transformers' ``--optim adamw_8bit`` builds ``bitsandbytes.optim.AdamW(optim_bits=8)``)."""
    if any(word in type(optimizer).__name__.lower() for word in QUANTIZED_STATE):
        return True
    bits = getattr(getattr(optimizer, "args", None), "optim_bits", 32)
    return type(optimizer).__module__.startswith("bitsandbytes") and isinstance(bits, int) and bits < 32


def checked_additions(
    optimizer: torch.optim.Optimizer, sharded: Iterable[torch.Tensor], report: Callable[[str], None]
) -> Callable[[dict[str, Any]], None]:
    """``optimizer.add_param_group`` that checks the optimizer again with the group added (and takes the group back
    out when refused): an Adafactor prepared with replicated parameters alone was given TP shards afterwards."""
    add, sharded = optimizer.add_param_group, list(sharded)

    def add_param_group(param_group: dict[str, Any]) -> None:
        add(param_group)
        try:
            check_elementwise_update(optimizer, sharded, report)
        except ConfigError:
            optimizer.param_groups.pop()
            raise

    return add_param_group


def check_named_update(name: str, report: Callable[[str], None]) -> None:
    """:func:`check_elementwise_update` by the optimizer's name (a class name, or a DeepSpeed JSON ``optimizer.type``
    next to TP): whole-tensor ones refused, unknown ones reported."""
    if name.lower() in ELEMENTWISE_NAMES:
        return
    if any(word in name.lower() for word in WHOLE_TENSOR):
        raise ConfigError(
            f"{name} computes its update from statistics of each whole tensor (factored moments, norms or matrix "
            "roots), and under tensor parallelism (or FSDP2) each rank holds a shard of some: it would train "
            "differently from one process. Use an optimizer that updates each element on its own (AdamW, Adam, SGD; "
            "TrainingArguments --optim adamw_torch), or TP 1 without FSDP2"
        )
    report(
        f"mtk: {name} updates split parameters shard by shard; that equals one process only if its update treats "
        "every element on its own (as AdamW and SGD do)"
    )
