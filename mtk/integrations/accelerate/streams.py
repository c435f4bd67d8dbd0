"""Iterable datasets under mtk's layouts: one stream per data-parallel replica, and its last batch's real rows.

accelerate dispatches an ``IterableDataset`` by default (process 0 reads it and hands each process a slice),
which mtk turns off where a replica spans ranks (:meth:`~mtk.integrations.accelerate.data_path.DataPath._dispatch`).
accelerate then reads it another way, with two consequences mtk corrects so that the data a replica sees and the
rows ``gather_for_metrics`` returns are plain accelerate's:

- a ``datasets.IterableDataset`` of at least ``dp`` shards is split by its shards (files), one set per replica:
  shards of different sizes give the replicas different numbers of batches, and the first to run out leaves the
  others waiting in a collective. :func:`one_stream_per_replica` has it read as any other iterable instead
  (accelerate's ``IterableDatasetShard``: every replica reads the stream and takes its slice of each batch of
  ``batch x dp`` rows, the rows dispatching gives each process).
- ``IterableDatasetShard`` fills the last batch with repeats of the first so the replicas stay even, and a stream
  has no length to tell ``gather_for_metrics`` how many rows were real: it kept the repeats (an evaluation over 10
  rows scored 12). :func:`count_stream_rows` counts the rows the stream yielded; :func:`stream_remainder` is
  accelerate's ``remainder`` from that count, which mtk's loaders set as a stream ends
  (:mod:`~mtk.integrations.accelerate.batches`). At dp = 1 the stream is read whole and its last batch is short,
  not filled: every row of it counts, as accelerate's dispatcher counts them (without it, that batch's loss was
  weighted as a full one's in the Trainer's ``eval_loss``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import accelerate.data_loader as accelerate_data_loader
from accelerate.data_loader import IterableDatasetShard
from accelerate.utils import find_batch_size
from torch.utils.data import IterableDataset

__all__ = ["count_stream_rows", "one_stream_per_replica", "stream_remainder"]


@contextlib.contextmanager
def one_stream_per_replica(forced: bool) -> Iterator[None]:
    """While accelerate prepares a loader whose dispatching mtk turned off (``forced``), a ``datasets`` stream is
    sharded as any ``IterableDataset`` (accelerate asks ``is_datasets_available`` before splitting it by shards)."""
    if not forced:
        yield
        return
    saved = accelerate_data_loader.is_datasets_available
    accelerate_data_loader.is_datasets_available = lambda: False
    try:
        yield
    finally:
        accelerate_data_loader.is_datasets_available = saved


class _CountedStream(IterableDataset):
    """The user's iterable dataset, counting the rows one pass yields (``rows``: ``None`` until the pass ends).
    Anything else (``set_epoch``, ``generator``, ``state_dict``) is the dataset's."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.rows: int | None = None

    def __iter__(self) -> Iterator[Any]:
        self.rows, count = None, 0
        for row in self.dataset:
            count += 1
            yield row
        self.rows = count

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # (not set yet: while unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)


def count_stream_rows(loader: Any) -> None:
    """Count the rows of ``loader``'s stream, where accelerate reads it through ``IterableDatasetShard``."""
    shard = getattr(loader, "dataset", None)
    if isinstance(shard, IterableDatasetShard) and not isinstance(shard.dataset, _CountedStream):
        shard.dataset = _CountedStream(shard.dataset)


def stream_remainder(loader: Any, last_batch: Any) -> int:
    """accelerate's ``remainder`` for ``loader``'s ``last_batch``: the real rows of its last global batch (0: a full
    one). A stream read through ``IterableDatasetShard`` (dp > 1) counts them; one read whole (dp = 1) has no
    repeats, so its last batch's rows are all real (as accelerate's dispatcher counts them). -1 where unknown: a
    stream read in worker processes, whose count stays there."""
    shard = getattr(loader, "dataset", None)
    if not isinstance(shard, IterableDatasetShard):
        return find_batch_size(last_batch) or -1
    counted = shard.dataset
    if not isinstance(counted, _CountedStream) or counted.rows is None:
        return -1
    rows_per_batch = shard.batch_size if shard.split_batches else shard.batch_size * shard.num_processes
    return counted.rows % rows_per_batch
