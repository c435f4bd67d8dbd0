"""FSDP2 in ``mtk.Accelerator``: which data-parallel rank holds which piece, what FSDP2 cannot go with yet, and
the sharding of a prepared model (or pipeline stage) over the data-parallel mesh, its optimizers re-pointed.
The configuration is read in :mod:`~mtk.integrations.accelerate.sharding`; the FSDP2 calls live in
:mod:`mtk.parallel.fsdp`."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mtk.config import RunSettings
from mtk.errors import ConfigError
from mtk.integrations.accelerate.convert import ReplacedParams
from mtk.parallel.fsdp import ShardingSettings, data_parallel_mesh, shard_over_data_parallel
from mtk.parallel.record import hf_model
from mtk.parallel.state import ParallelState
from mtk.pipeline.engine import PipelineModel

if TYPE_CHECKING:  # the mixin is checked as part of accelerate's Accelerator
    from accelerate import Accelerator as _Host
else:
    _Host = object

__all__ = ["ParameterSharding"]


class ParameterSharding(_Host):
    """FSDP2 over the data-parallel ranks (a mixin in front of accelerate's ``Accelerator``)."""

    parallel: ParallelState
    settings: RunSettings
    sharding: ShardingSettings | None
    _data_parallel_mesh: DeviceMesh | None
    _replaced_params: ReplacedParams

    @property
    def data_parallel_shard_rank(self) -> int:
        """This process's rank among the ranks FSDP2 shards over (``dp_shard``, times CP); 0 without FSDP2 (ZeRO,
        when used, shards over the whole data-parallel group)."""
        if self.sharding is None:
            return 0
        return self.parallel.replica_rank % (self.sharding.dp_shard_size * self.parallel.cp_size)

    def _check_sharding(self) -> None:
        """FSDP2 goes with TP and plain data parallelism; what it cannot go with yet is one line."""
        if self.sharding is None:
            return
        self.sharding.check(self.parallel.dp_size)
        if self.mixed_precision == "fp16":  # each rank would unscale, and find an inf in, only its own pieces
            raise ConfigError(
                "parallelism_config dp_shard_size > 1 (FSDP2) with fp16 loss scaling is not supported; use "
                "mixed_precision bf16"
            )
        if self.ddp_handler is not None:
            self.print("mtk: DistributedDataParallelKwargs are not used: FSDP2 reduces the gradients, not DDP")
        if self.parallel.pp_size > 1 and self.settings.virtual_stages > 1:
            raise ConfigError(
                "parallelism_config dp_shard_size > 1 (FSDP2) with the interleaved pipeline schedule is not supported "
                "yet (a rank runs its chunks through different FSDP roots); use 1f1b or afab with FSDP2"
            )
        if self.settings.use_distributed_optimizer:
            raise ConfigError(
                "parallelism_config dp_shard_size > 1 (FSDP2) already shards the optimizer state over data "
                "parallelism; drop megatron_lm_use_distributed_optimizer"
            )

    def _shard(self, model: nn.Module) -> None:
        """``fully_shard`` ``model`` over the data-parallel mesh; optimizers built on its parameters before (or on
        the HF model's) are re-pointed at the sharded ones when prepared."""
        assert self.sharding is not None
        if self._data_parallel_mesh is None:
            self._data_parallel_mesh = data_parallel_mesh(self.parallel, self.sharding)
        stage = self.unwrap_model(model)
        decoder = cast(Any, hf_model(stage)).base_model if isinstance(model, PipelineModel) else None
        pairs = shard_over_data_parallel(stage, self._data_parallel_mesh, self.sharding, decoder=decoder)
        by_old = {id(old): new for old, new in pairs}
        for key, (ref, shard) in list(self._replaced_params.items()):  # HF parameter -> TP shard -> its FSDP2 one
            if shard is not None and id(shard) in by_old:
                self._replaced_params[key] = (ref, by_old[id(shard)])
        for old, new in pairs:
            recorded = self._replaced_params.get(id(old))
            if recorded is None or recorded[0]() is not old:  # or recorded for a freed parameter whose id it reuses
                self._replaced_params[id(old)] = (weakref.ref(old), new)
