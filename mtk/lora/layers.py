"""LoRA on mtk's tensor-parallel linears, as a PEFT layer (registered through ``LoraConfig._register_custom_module``).

``W x + s * B A x`` with the low-rank factors sharded as Megatron shards LoRA (PEFT's ``LoraParallelLinear``
does the same for Megatron-core's layers):

- column-parallel base (``W`` split by output rows): ``A [r, in]`` replicated, ``B [out, r]`` split by output
  rows exactly as ``W`` (per part when fused, per kv head when kv heads are replicated). The adapter reads the
  base's input *after* it entered the TP region, so its input gradient joins the base's one all-reduce.
  ``A``'s gradient is a partial sum on each rank (each sees only its rows of dL/dY): it is summed over TP.
- row-parallel base (``W`` split by input columns): ``A [r, in]`` split by input columns as ``W``, ``B [out, r]``
  replicated. ``B (A_r x_r)`` is this rank's share of ``B A x``; it is added to the base's share *before* the
  base's reduction, so the one all-reduce (or reduce-scatter) sums both. ``B``'s gradient is summed over TP.

The forward needs no collective beyond the base layer's; the two sums over TP run in backward, in the graph
(``copy_to_tp`` on the replicated factor: identity forward, all-reduce of its gradient backward), so they are
right under any engine, pipeline schedule or accumulation. Merging is local: ``B_r A`` (column) and ``B A_r``
(row) have the shape of this rank's shard of ``W``.

Adapters start from full tensors drawn from a generator seeded by ``(seed, module name)`` and are then cut:
the same seed gives the same adapters at every TP/PP/DP layout.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from typing import Any, cast

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as PeftLinear
from torch import nn

from mtk.errors import ConfigError
from mtk.parallel.comm import copy_to_tp
from mtk.parallel.layers import ColumnParallelLinear, KVReplicatedColumnLinear, RowParallelLinear
from mtk.parallel.parameters import copy_param_info
from mtk.parallel.random import DEFAULT_STREAM, TP_STREAM, RNGStreams

__all__ = ["ParallelLoraLinear", "adapter_seed", "full_factors"]

INITS = (True, False, "gaussian")  # LoraConfig.init_lora_weights values that need no base weight
SEED_ATTRIBUTE = "mtk_seed"  # set on the LoraConfig by mtk.lora.get_peft_model: rank 0's seed, on every rank


def adapter_seed(seed: int, module_name: str) -> int:
    """The generator seed of one module's adapter: a function of the run's seed and the HF name only."""
    return (seed * 1_000_003 + zlib.crc32(module_name.encode())) % (2**63)


def full_factors(
    rows: int, in_features: int, out_features: int, init: bool | str, generator: torch.Generator, rank: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full ``A [rows, in]`` and ``B [out, rows]`` as PEFT initializes them (on the CPU, fp32). ``rows``: the
    adapter's rank, or ``r·E`` for the factors of a 3D tensor of ``E`` experts, whose gaussian draws still use the
    adapter's ``rank``."""
    a, b = torch.empty(rows, in_features, device="cpu"), torch.zeros(out_features, rows, device="cpu")
    if init == "gaussian":
        a.normal_(std=1 / (rank or rows), generator=generator)
        return a, b
    bound = 1 / math.sqrt(in_features)  # nn.Linear's default (kaiming_uniform_ with a = sqrt(5))
    a.uniform_(-bound, bound, generator=generator)
    if init is False:  # PEFT leaves both factors as nn.Linear made them (B's fan-in is its rows)
        b.uniform_(-1 / math.sqrt(rows), 1 / math.sqrt(rows), generator=generator)
    return a, b


class ParallelLoraLinear(PeftLinear):
    """PEFT's LoRA ``Linear`` whose base is an mtk :class:`ColumnParallelLinear` or :class:`RowParallelLinear`.

    PEFT's merge, unmerge, adapter switching and state-dict naming are inherited; the factors are sharded
    (module docstring) and ``forward`` runs the base in its three steps around the adapters.
    """

    rng: RNGStreams | None = None  # set by mtk.lora: column dropouts draw from the default stream, rows per rank

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: Any, **kwargs: Any) -> None:
        base: Any = base_layer.get_base_layer() if hasattr(base_layer, "get_base_layer") else base_layer  # type: ignore[operator]
        unsupported = [
            name
            for name, on in (
                ("use_dora", config.use_dora),
                ("lora_bias", config.lora_bias),
                ("use_bdlora", getattr(config, "use_bdlora", None)),
                ("alora_invocation_tokens", getattr(config, "alora_invocation_tokens", None)),
                ("velora_config", getattr(config, "velora_config", None)),
                ("arrow_config", getattr(config, "arrow_config", None)),
            )
            if on
        ]
        if unsupported:
            raise ConfigError(f"LoRA on tensor-parallel layers does not support {', '.join(unsupported)}; turn it off")
        if config.init_lora_weights not in INITS:
            raise ConfigError(
                f"init_lora_weights={config.init_lora_weights!r} needs the whole base weight; on tensor-parallel "
                f"layers use one of {list(INITS)}"
            )
        self.is_row = isinstance(base, RowParallelLinear)
        super().__init__(base_layer, adapter_name, config, **kwargs)
        self.fan_in_fan_out = bool(base.transposed)  # GPT-2's Conv1D keeps [in, out]: merged deltas are transposed

    def _get_in_out_features(self, module: Any) -> tuple[int, int]:
        return module.in_features, module.out_features  # full sizes: A is [r, in], B is [out, r]

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config: Any, **kwargs: Any) -> None:
        """PEFT's bookkeeping, with sharded factors cut from full ones drawn from this module's own generator."""
        if r <= 0:
            raise ConfigError(f"LoRA rank r={r} must be a positive integer")
        base: Any = self.get_base_layer()
        self.r[adapter_name], self.lora_alpha[adapter_name] = r, lora_alpha
        dropout = nn.Dropout(p=config.lora_dropout) if config.lora_dropout > 0 else nn.Identity()
        self.lora_dropout[adapter_name] = dropout
        self.scaling[adapter_name] = lora_alpha / (math.sqrt(r) if config.use_rslora else r)
        self.use_rslora[adapter_name], self.use_dora[adapter_name] = config.use_rslora, False
        self.lora_bias[adapter_name] = False
        lora_a, lora_b = self._factors(base, r)
        seed = getattr(config, SEED_ATTRIBUTE, None)
        seed = torch.initial_seed() if seed is None else seed
        generator = torch.Generator().manual_seed(adapter_seed(seed, kwargs.get("target_name", "")))
        n_in, n_out = base.in_features, base.out_features
        full_a, full_b = full_factors(r, n_in, n_out, config.init_lora_weights, generator)
        for module, full in ((lora_a, full_a), (lora_b, full_b)):
            marked = dict(module.named_parameters())
            module.to_empty(device=base.weight.device)  # new parameters: they keep the shards' marks (grad norms)
            for name, param in module.named_parameters():
                copy_param_info(marked[name], param)
            with torch.no_grad():
                if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                    module.load_full(full.to(base.weight.device))
                else:
                    cast(torch.Tensor, module.weight).copy_(full)
        self.lora_A[adapter_name], self.lora_B[adapter_name] = lora_a, lora_b
        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

    def _factors(self, base: Any, r: int) -> tuple[nn.Module, nn.Module]:
        """Empty ``A``, ``B`` (on the meta device: no draw from the global generator) sharded to match ``base``."""
        meta: dict[str, Any] = {"device": "meta", "dtype": torch.float32}
        if self.is_row:
            a = RowParallelLinear(base.in_features, r, bias=False, tp_group=base.tp_group, **meta)
            return a, nn.Linear(r, base.out_features, bias=False, **meta)
        if isinstance(base, KVReplicatedColumnLinear):
            b: ColumnParallelLinear = KVReplicatedColumnLinear(
                r, base.num_kv_heads, base.head_dim, bias=False, tp_group=base.tp_group, kv_group=base.kv_group, **meta
            )
        else:
            b = ColumnParallelLinear(
                r,
                base.out_features,
                bias=False,
                tp_group=base.tp_group,
                output_sizes=base.output_sizes,
                pad_to_multiple_of=base.pad_to_multiple_of,
                **meta,
            )
        return nn.Linear(base.in_features, r, bias=False, **meta), b

    def reset_lora_parameters(self, adapter_name: str, init_lora_weights: Any) -> None:
        """Adapters are initialized from full tensors in :meth:`update_layer`, never per shard."""

    def _dropout_stream(self) -> contextlib.AbstractContextManager:
        """A row adapter's input is this rank's slice (its own masks); a column's is replicated (shared masks)."""
        if self.rng is None:
            return contextlib.nullcontext()
        return self.rng.fork(TP_STREAM if self.is_row else DEFAULT_STREAM)

    def _adapter(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``s * B A x`` for this rank: its output columns (column base) or its share of the sum (row base)."""
        lora_a, lora_b = cast(Any, self.lora_A[name]), cast(Any, self.lora_B[name])
        base: Any = self.get_base_layer()
        with self._dropout_stream():
            x = self.lora_dropout[name](self._cast_input_dtype(x, lora_a.weight.dtype))
        if self.is_row:
            h = F.linear(x, lora_a.weight)  # [b, s, in/tp] -> [b, s, r], this rank's share
            return F.linear(h, copy_to_tp(lora_b.weight, base.tp_group)) * self.scaling[name]  # [b, s, out]
        h = F.linear(x, copy_to_tp(lora_a.weight, base.tp_group))  # [b, s, in] -> [b, s, r]
        return lora_b.local(h) * self.scaling[name]  # [b, s, out/tp]

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.pop("adapter_names", None) is not None:
            raise ConfigError("adapter_names (mixed-adapter batches) is not supported on tensor-parallel LoRA layers")
        base: Any = self.get_base_layer()
        if self.disable_adapters and self.merged:
            self.unmerge()
        active = [a for a in self.active_adapters if a in self.lora_A]
        if self.disable_adapters or self.merged or not active:
            return base(x)
        x_in = base.enter(x)  # column: [b, s, in] (its backward all-reduce carries the adapter's share too)
        out = base.local(x_in)  # column: [b, s, out/tp]; row: [b, s, out], this rank's share
        for name in active:
            out = out + self._adapter(name, x_in).to(out.dtype)
        return base.leave(out)

    def __repr__(self) -> str:
        return "mtk." + super().__repr__()
