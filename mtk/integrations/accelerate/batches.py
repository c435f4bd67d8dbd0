"""accelerate's prepared DataLoaders, yielding the model-parallel source rank's batch on every rank of a replica.

With tp x pp > 1 every rank of one model replica must compute on the same batch; a loader that shuffles with
a per-process seed, or pads to each batch's longest sequence, gives each rank its own. Megatron broadcasts
each batch from the TP source rank (``broadcast_data``); ``mtk.Accelerator.prepare_data_loader`` returns the
loader accelerate prepared as a subclass of its own class (:class:`DataLoaderShard`,
:class:`DataLoaderDispatcher`) whose iteration does that
(:func:`~mtk.parallel.consistency.broadcast_batches`): the same object for accelerate's bookkeeping
(``gradient_state.active_dataloader``, ``end_of_dataloader``, checkpoints), every rank still drawing from its
own loader, the batch it yields the source's.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard

from mtk.parallel.comm import Group
from mtk.parallel.consistency import BroadcastBatches, broadcast_batches

__all__ = ["broadcasting", "unwrapped"]


class _FromSource:
    """Mixin: iterate as the base class does, yielding the source rank's batches."""

    _mtk_source: tuple[Group, int, torch.device]  # the model-parallel group, its source rank, the device

    def __iter__(self):
        group, src, device = self._mtk_source
        return broadcast_batches(super().__iter__(), group, src, device)


class BroadcastingDataLoaderShard(_FromSource, DataLoaderShard):
    """accelerate's :class:`DataLoaderShard`; every batch is the model-parallel source rank's."""


class BroadcastingDataLoaderDispatcher(_FromSource, DataLoaderDispatcher):
    """accelerate's :class:`DataLoaderDispatcher`; every batch is the model-parallel source rank's."""


_SUBCLASSES = {DataLoaderShard: BroadcastingDataLoaderShard, DataLoaderDispatcher: BroadcastingDataLoaderDispatcher}


def broadcasting(loader: Any, group: Group, src: int, device: torch.device) -> Any:
    """``loader`` (as ``prepare_data_loader`` made it) yielding the source's batches: the same state in the
    broadcasting subclass of its class, or, for a class accelerate adds later, a :class:`BroadcastBatches` view."""
    subclass = _SUBCLASSES.get(type(loader))
    if subclass is None:
        return BroadcastBatches(loader, group, src, device)
    broadcasting_loader = object.__new__(subclass)
    broadcasting_loader.__dict__.update(loader.__dict__)  # the prepared loader's state, not a copy of its data
    broadcasting_loader._mtk_source = (group, src, device)
    return broadcasting_loader


def unwrapped(loader: Any) -> Any:
    """The loader accelerate's own functions (``skip_first_batches``) can take."""
    return loader.loader if isinstance(loader, BroadcastBatches) else loader
