"""Expert parallelism: each MoE layer's experts spread over an EP group, tokens sent to their experts by all-to-all.

An EP group is ``ep`` ranks that hold the same dense weights but different batches (Megatron carves it out of the
data-parallel ranks). Each rank keeps experts ``[r E/ep, (r+1) E/ep)`` of every MoE layer; the router stays
whole, so every rank routes its own tokens over all ``E`` experts exactly as one process would. Then (dropless:
no capacity, no token dropped):

1. every (token, choice) pair is sorted by its expert, hence by the rank that holds it, and the per-rank counts
   are exchanged (one small all-to-all);
2. the tokens' hidden states go to those ranks (an all-to-all of uneven splits) with their local expert ids;
3. each rank runs its experts on what it received, through the model's own experts code (whatever
   ``_experts_implementation`` it had: eager, ``grouped_mm``, ...) with every routing weight 1 and ``num_experts``
   its local count;
4. the outputs come back by the reverse all-to-all, are weighted by the routing weights on the token's own rank,
   and summed per token.

The exchange is registered in transformers' ``ExpertsInterface`` (as ``"mtk_expert_parallel"``) and set as the
model config's ``_experts_implementation``, the way context parallelism's attention goes through the
``AttentionInterface``. The output, the router's gradient (through the weights, applied where the token lives) and
the hidden states' gradient are one process's; each expert's gradient is the sum over the EP group's tokens routed
to it. Gradients of the experts are therefore reduced over the *expert-data-parallel* group (the ranks holding the
same experts), the dense ones over DP as before; both divided by the same replica count.

Under tensor parallelism inside the experts (Megatron's expert-tensor parallelism equal to TP) each TP rank
exchanges its copy of the same tokens with its counterparts in the other TP groups and computes its slice of the
intermediate width; :mod:`mtk.parallel.experts` then sums the slices over TP after the combine, as without EP. With
the experts' TP size 1 each TP rank exchanges only its share of the tokens and runs its experts whole
(:mod:`mtk.parallel.expert_tokens`, whose hooks surround this exchange).

The backward pass issues the conjugate all-to-alls on every rank, also on one whose experts received no token: the
returning exchange is anchored to the dispatched rows so that autograd always reaches it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from mtk.errors import UnsupportedModelError
from mtk.parallel.comm import Group, all_reduce, group_rank, group_size
from mtk.parallel.expert_tokens import TOKENS_TP_GROUP_ATTRIBUTE
from mtk.parallel.grads import sum_grad_over_tp
from mtk.parallel.overlap import gradient_buckets
from mtk.parallel.parameters import copy_param_info, is_expert_parallel, param_info, set_param_info

__all__ = [
    "EXPERT_PARALLEL_ATTRIBUTE",
    "EXPERTS_IMPLEMENTATION",
    "LAYOUT_ATTRIBUTE",
    "ExpertLayout",
    "ExpertPlacement",
    "distribute_experts",
    "expert_parallel_forward",
    "expert_placement",
    "experts_piece",
    "is_expert_parallel",
    "local_experts_implementation",
    "reduce_expert_gradients",
    "own_expert_rows",
    "spread_experts",
    "spread_layout",
    "whole_piece",
]

EXPERT_PARALLEL_ATTRIBUTE = "mtk_expert_parallel"  # the ExpertPlacement of an experts module spread over EP
LAYOUT_ATTRIBUTE = "mtk_expert_layout"  # the ExpertLayout of a spread tensor that is not its module's experts tensor
EXPERTS_IMPLEMENTATION = "mtk_expert_parallel"  # the name of expert_parallel_forward in transformers' ExpertsInterface
_EXPERT_TENSORS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


@dataclass(frozen=True)
class ExpertLayout:
    """Where a spread tensor holds its experts: dim ``dim`` of its shape is ``outer x local x inner`` (expert
    ``first + e`` at the middle index ``e``). An experts tensor ``[E/ep, ...]`` is dim 0 with ``outer = inner = 1``;
    PEFT's LoRA factors of one are ``lora_A [r E/ep, in]`` (dim 0, ``inner = r``: expert-major rows) and
    ``lora_B [out, r E/ep]`` (dim 1, ``outer = r``: the expert index fastest). The tensor of all ``E`` experts is
    the same with ``E`` in the middle, so one description serves the exchange's gather, the checkpoint's pieces
    and the resharding reader."""

    placement: ExpertPlacement
    dim: int = 0
    outer: int = 1
    inner: int = 1

    def _split(self, shape: tuple[int, ...], experts: int) -> tuple[int, ...]:
        """``shape`` with dim ``dim`` split into ``(outer, experts, inner)``; the experts' axis is ``dim + 1``."""
        return (*shape[: self.dim], self.outer, experts, self.inner, *shape[self.dim + 1 :])

    def whole_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the tensor of every expert, of which ``local_shape`` holds this rank's."""
        size = self.outer * self.placement.num_experts * self.inner
        return (*local_shape[: self.dim], size, *local_shape[self.dim + 1 :])

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's experts of ``local``, in global order (collective over the EP group)."""
        axis = self.dim + 1
        split = local.reshape(self._split(tuple(local.shape), self.placement.local)).movedim(axis, 0).contiguous()
        gathered = split.new_empty((self.placement.num_experts, *split.shape[1:]))  # [E, ...]
        dist.all_gather_into_tensor(gathered, split, group=self.placement.group)
        return gathered.movedim(0, axis).reshape(self.whole_shape(tuple(local.shape)))

    def own_shape(self, whole_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this rank's experts of a tensor of every expert shaped ``whole_shape``."""
        size = self.outer * self.placement.local * self.inner
        return (*whole_shape[: self.dim], size, *whole_shape[self.dim + 1 :])

    def own(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's experts of ``whole``, the tensor of every expert."""
        split = whole.reshape(self._split(tuple(whole.shape), self.placement.num_experts))
        mine = split.narrow(self.dim + 1, self.placement.first, self.placement.local)
        return mine.reshape(self.own_shape(tuple(whole.shape)))

    def own_rows(self) -> tuple[int, int] | None:
        """This rank's experts as rows ``[start, stop)`` of dim 0 of the whole tensor, where they are such rows
        (``None`` otherwise: ``lora_B``'s columns interleave the experts)."""
        if self.dim != 0 or self.outer != 1:
            return None
        return self.placement.first * self.inner, (self.placement.first + self.placement.local) * self.inner


@dataclass(frozen=True)
class ExpertPlacement:
    """Where one experts module's experts live: ``local`` consecutive experts per rank of ``group``."""

    group: Group
    num_experts: int  # E, every expert of the layer
    local: int  # E / ep, held here
    rank: int  # this rank's index in the EP group
    local_forward: Callable[..., torch.Tensor]  # the model's own experts code, run on this rank's experts

    @property
    def size(self) -> int:
        return self.num_experts // self.local

    @property
    def first(self) -> int:
        """The global index of this rank's first expert."""
        return self.rank * self.local


class _Exchange(torch.autograd.Function):
    """All-to-all of rows with uneven splits; backward is the same exchange reversed."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, sent: list[int], received: list[int], group: Group) -> torch.Tensor:
        ctx.sent, ctx.received, ctx.group = sent, received, group
        out = rows.new_empty((sum(received), *rows.shape[1:]))  # [sum(received), ...]
        dist.all_to_all_single(out, rows.contiguous(), received, sent, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        back = grad.new_empty((sum(ctx.sent), *grad.shape[1:]))  # [sum(sent), ...]
        dist.all_to_all_single(back, grad.contiguous(), ctx.sent, ctx.received, group=ctx.group)
        return back, None, None, None


class _Return(torch.autograd.Function):
    """The outputs' way back (the reverse exchange), anchored to the dispatched rows and to the experts' trainable
    tensors: if this rank's experts got no token their output needs no gradient, yet its backward must still
    exchange with the other ranks (the rows' anchor keeps the dispatch's backward going too)."""

    @staticmethod
    def forward(
        ctx: Any, out: torch.Tensor, sent: list[int], received: list[int], group: Group, *anchors: torch.Tensor
    ) -> torch.Tensor:
        ctx.sent, ctx.received, ctx.group = sent, received, group
        ctx.rows_shape = anchors[0].shape  # the dispatched rows; then the experts' tensors
        back = out.new_empty((sum(sent), *out.shape[1:]))  # [sum(sent), ...]: the rows this rank dispatched
        dist.all_to_all_single(back, out.contiguous(), sent, received, group=group)
        return back

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_grad = grad.new_empty((sum(ctx.received), *grad.shape[1:]))  # [sum(received), ...]
        dist.all_to_all_single(out_grad, grad.contiguous(), ctx.received, ctx.sent, group=ctx.group)
        rows_grad = grad.new_zeros(ctx.rows_shape) if ctx.needs_input_grad[4] else None  # [M, H]
        return (out_grad, None, None, None, rows_grad) + (None,) * (len(ctx.needs_input_grad) - 5)


def _exchange_ints(values: torch.Tensor, sent: list[int], received: list[int], group: Group) -> torch.Tensor:
    out = values.new_empty(sum(received))
    dist.all_to_all_single(out, values.contiguous(), received, sent, group=group)
    return out


def expert_parallel_forward(
    module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts' output for this rank's tokens, computed where the experts live (module docstring)."""
    placement: ExpertPlacement | None = getattr(module, EXPERT_PARALLEL_ATTRIBUTE, None)
    if placement is None:
        raise UnsupportedModelError(
            f"{type(module).__name__} shares its config with experts spread over EP but was not spread itself"
        )
    group, local = placement.group, placement.local
    tokens, chosen = top_k_index.shape  # [T, k]
    flat = top_k_index.reshape(-1)  # [T k] global expert ids
    order = torch.argsort(flat, stable=True)  # [T k]: pairs grouped by expert, hence by the rank holding it
    expert = flat[order]  # [T k]
    token = torch.div(order, chosen, rounding_mode="floor")  # [T k]: each sorted pair's token
    counts = torch.bincount(torch.div(expert, local, rounding_mode="floor"), minlength=placement.size)  # [ep]
    incoming = torch.empty_like(counts)
    dist.all_to_all_single(incoming, counts, group=group)
    sent, received = counts.tolist(), incoming.tolist()
    rows = _Exchange.apply(hidden[token], sent, received, group)  # [M, H]: the tokens this rank's experts take
    ids = _exchange_ints(expert, sent, received, group) - placement.first  # [M] local expert ids
    ones = torch.ones((rows.shape[0], 1), dtype=top_k_weights.dtype, device=rows.device)  # [M, 1]
    out = placement.local_forward(module, rows, ids.unsqueeze(-1), ones)  # [M, H]
    trained = [p for p in module.parameters(recurse=False) if p.requires_grad]
    back = _Return.apply(out, sent, received, group, rows, *trained)  # [T k, H] in sorted order
    by_token = back[torch.argsort(order)].view(tokens, chosen, -1)  # [T, k, H]: each token's k outputs
    # summed over k in fp32 at least, as transformers' grouped experts do (index_add in bf16 would round each
    # addition; fp64 stays fp64)
    wide = torch.promote_types(hidden.dtype, torch.float32)
    combined = (by_token.to(wide) * top_k_weights.to(wide).unsqueeze(-1)).sum(dim=1)  # [T, H]
    return combined.to(hidden.dtype)


def _local_forward(module: nn.Module) -> Any:
    """The experts code the model would run (its configured ``_experts_implementation``), for local experts."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    original = getattr(type(module).forward, "__wrapped__", None)
    config = getattr(module, "config", None)
    if original is None or config is None:
        raise UnsupportedModelError(
            f"{type(module).__name__}: expert parallelism needs experts dispatched through transformers' "
            "ExpertsInterface (@use_experts_implementation); this model's experts are not"
        )
    if expert_placement(module) is not None:
        raise UnsupportedModelError(f"{type(module).__name__}: its experts are spread over EP already")
    implementation = getattr(config, "_experts_implementation", None) or "eager"
    if implementation == EXPERTS_IMPLEMENTATION:
        raise UnsupportedModelError(
            f"{type(module).__name__} shares its config with experts spread already: spread a model's experts "
            "together (spread_experts)"
        )
    return ALL_EXPERTS_FUNCTIONS.get_interface(implementation, original)


def distribute_experts(
    module: nn.Module,
    group: Group,
    local_forward: Callable[..., torch.Tensor] | None = None,
    read_local: bool = False,
) -> ExpertPlacement:
    """Keep this rank's experts of ``module`` (in place) and route its forward through the EP exchange.

    ``module`` is a transformers experts module (3D expert tensors, ``num_experts``), materialized; the experts must
    divide evenly over the group. ``local_forward``: the experts code it runs on its own experts (default: the
    config's ``_experts_implementation``, read before the config names the exchange instead). ``read_local``: its
    expert tensors hold this rank's experts already (a loader read only those: :func:`own_expert_rows`)."""
    size, rank = group_size(group), group_rank(group)
    experts = int(getattr(module, "num_experts", 0))
    if experts < 1 or not hasattr(module, "down_proj"):
        raise UnsupportedModelError(f"{type(module).__name__}: expert parallelism needs 3D expert tensors")
    if experts % size:
        raise UnsupportedModelError(
            f"{type(module).__name__}: {experts} experts do not divide over expert parallelism {size}; use an "
            f"expert-parallel size that divides {experts}"
        )
    unknown = [
        name
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        if name not in _EXPERT_TENSORS and tensor.dim() > 0 and tensor.shape[0] == experts
    ]
    if unknown:  # e.g. fp8 scales per expert: left whole, they would index the wrong experts
        raise UnsupportedModelError(
            f"{type(module).__name__}: per-expert tensors {unknown} are not spread over EP yet; run at EP 1"
        )
    placement = ExpertPlacement(group, experts, experts // size, rank, local_forward or _local_forward(module))
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    for name in _EXPERT_TENSORS:
        old = getattr(module, name, None)
        if not isinstance(old, nn.Parameter):
            continue
        if old.shape[0] != (placement.local if read_local else experts):
            raise UnsupportedModelError(f"{type(module).__name__}.{name}: shape {tuple(old.shape)} is not per expert")
        if old.device.type == "meta":  # parallelize leaves a model read slice by slice to its loader (hf_load)
            raise UnsupportedModelError(
                f"{type(module).__name__}: its experts are not read yet; spread them once the model is loaded"
            )
        mine = slice(None) if read_local else slice(placement.first, placement.first + placement.local)
        data = old.detach()[mine].clone()  # [E/ep, ...]
        param = nn.Parameter(data, requires_grad=old.requires_grad)
        copy_param_info(old, param)  # TP's marks (the experts' TP split) stay
        set_param_info(param, expert_parallel=True)
        if param_info(param).tp_shared:  # experts whole on each TP rank: the gradient hook belongs to the tensor
            sum_grad_over_tp(param, getattr(module, TOKENS_TP_GROUP_ATTRIBUTE))
        setattr(module, name, param)
    module.num_experts = placement.local  # type: ignore[assignment]  # the local experts code counts its own
    setattr(module, EXPERT_PARALLEL_ATTRIBUTE, placement)
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, expert_parallel_forward)
    cast(Any, module.config)._experts_implementation = EXPERTS_IMPLEMENTATION  # (not written by save_pretrained)
    return placement


def spread_experts(model: nn.Module, group: Group, stages: Group = None, read_local: bool = False) -> int:
    """Spread every experts module of ``model`` over ``group`` (:func:`distribute_experts`); how many there were.
    A model without one is one line: expert parallelism would do nothing. ``stages``: the pipeline group when
    ``model`` is one stage of the model; a stage of dense layers only has nothing to spread, and the line is for a
    model no stage of which has an MoE layer (collective over ``stages``). ``read_local``: a loader read each
    rank's own experts only."""
    modules = [m for m in model.modules() if hasattr(m, "num_experts") and hasattr(m, "down_proj")]
    found = all_reduce(torch.tensor([len(modules)], device=_device_of(model)), stages)
    if not int(found.item()):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no mixture-of-experts layer (3D expert tensors): expert parallelism has "
            "nothing to spread; set the expert-parallel size to 1"
        )
    forwards = [_local_forward(module) for module in modules]  # before the shared config names the exchange
    for module, forward in zip(modules, forwards):
        distribute_experts(module, group, forward, read_local)
    return len(modules)


def own_expert_rows(module: nn.Module, name: str, group: Group) -> tuple[int, int] | None:
    """The experts ``[start, stop)`` this rank of ``group`` will hold of tensor ``name`` of ``module``, for a loader
    to read those rows only; ``None`` where it reads the whole tensor (not an experts module's expert tensor, EP 1, or
    experts that do not divide: :func:`distribute_experts` then says so in one line)."""
    size = group_size(group)
    experts = int(getattr(module, "num_experts", 0) or 0)
    if size == 1 or name not in _EXPERT_TENSORS or not hasattr(module, "down_proj") or experts % size or not experts:
        return None
    local = experts // size
    start = group_rank(group) * local
    return start, start + local


def _device_of(model: nn.Module) -> torch.device:
    """Where a collective on ``model``'s behalf puts its tensor (the device of its first real parameter)."""
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


@torch.no_grad()
def reduce_expert_gradients(params: list[torch.Tensor], group: Group, replicas: int) -> None:
    """Average the experts' gradients as data parallelism averages the dense ones: summed over the ranks holding the
    same experts (each already holds its whole EP group's tokens' share) and divided by all ``replicas``. One
    all-reduce per bucket of DDP's size (a flat copy of one bucket at a time, not of every expert); in place, with
    no collective, where no other rank holds these experts. An expert that got no token contributes zeros (every
    rank must take part)."""
    experts = [p for p in params if is_expert_parallel(p) and p.requires_grad]
    if not experts:
        return
    for param in experts:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    grads = [cast(torch.Tensor, p.grad) for p in experts]
    if group_size(group) == 1:
        for grad in grads:
            grad.div_(replicas)
        return
    for bucket in gradient_buckets([(g.numel() * g.element_size(), g.dtype) for g in grads]):
        same = [grads[i] for i in bucket]
        flat = torch.cat([g.reshape(-1) for g in same])  # [bucket elements]
        dist.all_reduce(flat, group=group)
        flat.div_(replicas)
        for grad, chunk in zip(same, flat.split([g.numel() for g in same])):
            grad.copy_(chunk.view_as(grad))


def spread_layout(model: nn.Module, name: str) -> ExpertLayout | None:
    """How parameter ``name`` of ``model`` holds this rank's experts where EP spread it (else ``None``): an experts
    tensor by its module's placement, a tensor spread with them (LoRA's factors of one) by its own layout."""
    param = model.get_parameter(name)
    if not is_expert_parallel(param):
        return None
    layout = getattr(param, LAYOUT_ATTRIBUTE, None)
    if layout is not None:
        return layout
    placement = expert_placement(model.get_submodule(name.rpartition(".")[0]))
    return ExpertLayout(placement) if placement is not None else None


def experts_piece(
    tensor: torch.Tensor, layout: ExpertLayout
) -> tuple[torch.Tensor, tuple[int, int], tuple[int, ...]] | None:
    """A spread tensor (or one of its optimizer moments) as a flat piece of the tensor of all ``E`` experts:
    ``(values, (start, stop), whole shape)``. This rank's experts are consecutive rows, so they are one contiguous
    run of the row-major whole; a checkpoint stores each EP rank's run (:mod:`mtk.parallel.pieces`) and no rank
    gathers the experts. ``None`` where this rank's experts are no such run (LoRA's ``lora_B``, the expert index
    fastest): :func:`whole_piece` then writes the tensor whole."""
    rows = layout.own_rows()
    if rows is None:
        return None
    row = math.prod(tensor.shape[1:])
    return tensor.detach().reshape(-1), (rows[0] * row, rows[1] * row), layout.whole_shape(tuple(tensor.shape))


def whole_piece(
    tensor: torch.Tensor, layout: ExpertLayout
) -> tuple[torch.Tensor, tuple[int, int], tuple[int, ...]] | None:
    """A spread tensor whose experts are no contiguous run (a LoRA factor, small beside the experts) gathered over
    its EP group, as the piece of its EP rank 0 (``None`` on the others). Collective over the EP group."""
    whole = layout.gather(tensor.detach())
    if layout.placement.rank != 0:
        return None
    return whole.reshape(-1), (0, whole.numel()), tuple(whole.shape)


def local_experts_implementation(model: nn.Module, implementation: str) -> int:
    """Run every spread experts module's own experts with another of transformers' experts implementations (e.g.
    ``"eager"``: torch's grouped matmul takes no fp64), the exchange around them unchanged; how many there were."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    spread = [m for m in model.modules() if expert_placement(m) is not None]
    for module in spread:
        original = type(module).forward.__wrapped__  # type: ignore[attr-defined]  # use_experts_implementation's
        local_forward = ALL_EXPERTS_FUNCTIONS.get_interface(implementation, original)
        setattr(
            module,
            EXPERT_PARALLEL_ATTRIBUTE,
            replace(cast(ExpertPlacement, expert_placement(module)), local_forward=local_forward),
        )
    return len(spread)


def expert_placement(module: nn.Module) -> ExpertPlacement | None:
    """The placement of an experts module spread over EP; ``None`` for any other module."""
    return getattr(module, EXPERT_PARALLEL_ATTRIBUTE, None)
