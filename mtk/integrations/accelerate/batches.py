"""accelerate's prepared DataLoaders, yielding the batch group's source rank's batch on every rank of a replica.

With tp x cp x pp > 1 every rank of one model replica must compute on the same batch; a loader that shuffles with
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

from mtk.integrations.accelerate.streams import stream_remainder
from mtk.parallel.comm import Group
from mtk.parallel.consistency import BroadcastBatches, broadcast_batches

__all__ = ["broadcasting", "unwrapped"]


class _MtkLoader:
    """Mixin: iterate as the base class does, yielding the source rank's batches (``_mtk_source``), and ending a
    stream with its ``remainder`` (:func:`~mtk.integrations.accelerate.streams.stream_remainder`)."""

    _mtk_source: tuple[Group, int, torch.device] | None = None  # the batch group, its source, the device
    _mtk_stream: bool = False  # a dataset without a length, read without accelerate's dispatching

    def __iter__(self):
        batches = super().__iter__()
        if self._mtk_source is not None:
            batches = broadcast_batches(batches, *self._mtk_source)
        for batch in batches:
            if self._mtk_stream and self.end_of_dataloader:
                self.remainder = stream_remainder(self, batch)
            yield batch


class BroadcastingDataLoaderShard(_MtkLoader, DataLoaderShard):
    """accelerate's :class:`DataLoaderShard`; every batch is the batch group source rank's (a stream's last
    batch says how many of its rows are real)."""


class BroadcastingDataLoaderDispatcher(_MtkLoader, DataLoaderDispatcher):
    """accelerate's :class:`DataLoaderDispatcher`; every batch is the batch group source rank's."""


_SUBCLASSES = {DataLoaderShard: BroadcastingDataLoaderShard, DataLoaderDispatcher: BroadcastingDataLoaderDispatcher}


def broadcasting(loader: Any, group: Group | None, src: int, device: torch.device, stream: bool = False) -> Any:
    """``loader`` (as ``prepare_data_loader`` made it) yielding the source's batches where ``group`` is given, and
    with a ``stream``'s remainder: the same state in mtk's subclass of its class, or, for a class accelerate adds
    later, a :class:`BroadcastBatches` view (``loader`` itself where there is nothing to do)."""
    subclass = _SUBCLASSES.get(type(loader))
    if subclass is None:
        return loader if group is None else BroadcastBatches(loader, group, src, device)
    if group is None and not (stream and subclass is BroadcastingDataLoaderShard):
        return loader
    mtk_loader = object.__new__(subclass)
    mtk_loader.__dict__.update(loader.__dict__)  # the prepared loader's state, not a copy of its data
    mtk_loader._mtk_source = None if group is None else (group, src, device)
    mtk_loader._mtk_stream = stream and subclass is BroadcastingDataLoaderShard
    return mtk_loader


def unwrapped(loader: Any) -> Any:
    """The loader accelerate's own functions (``skip_first_batches``) can take."""
    return loader.loader if isinstance(loader, BroadcastBatches) else loader
