"""What ``mtk.Accelerator`` does with the data: loaders sharded over the data-parallel replicas (every rank of a
replica gets its source rank's batches), skipping to a checkpoint's position, and the step windows of a loop with
the data position that checkpoints record (``micro_batches_seen``, ``completed_steps``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from accelerate.data_loader import prepare_data_loader
from torch.utils.data import IterableDataset

from mtk.errors import ConfigError
from mtk.integrations.accelerate.batches import broadcasting, unwrapped
from mtk.integrations.accelerate.streams import count_stream_rows, one_stream_per_replica
from mtk.parallel.state import ParallelState
from mtk.training.windows import StepWindow, step_windows

if TYPE_CHECKING:  # the mixin is checked as part of accelerate's Accelerator
    from accelerate import Accelerator as _Host
else:
    _Host = object

__all__ = ["DataPath"]


class DataPath(_Host):
    """The data path of ``mtk.Accelerator`` (a mixin in front of accelerate's ``Accelerator``)."""

    parallel: ParallelState
    micro_batches_seen: int
    completed_steps: int
    step: int  # accelerate's count of micro-batches since the last sync

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """accelerate's, sharded over the data-parallel replicas; with tp x cp x pp > 1 every batch is the replica's
        source rank's (:mod:`~mtk.integrations.accelerate.batches`: what Megatron's ``broadcast_data`` does),
        however each rank's loader draws."""
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        dispatch = self._dispatch(data_loader)
        forced = dispatch is False and self.parallel.dp_size != self.num_processes  # (mtk's choice, not the user's)
        with one_stream_per_replica(forced and isinstance(data_loader.dataset, IterableDataset)):
            prepared = self._prepare_shard(data_loader, device_placement, slice_fn_for_dispatch, dispatch)
        count_stream_rows(prepared)
        prepared = self._broadcasting(prepared)
        self._dataloaders.append(prepared)
        return prepared

    def _prepare_shard(self, data_loader, device_placement, slice_fn_for_dispatch, dispatch):
        """accelerate's ``prepare_data_loader`` over the data-parallel replicas."""
        return prepare_data_loader(
            data_loader,
            self.device,
            num_processes=self.parallel.dp_size,  # shard over data-parallel replicas, not processes
            process_index=self.parallel.dp_rank,
            split_batches=self.split_batches,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            rng_types=self.rng_types.copy(),
            dispatch_batches=dispatch,
            even_batches=self.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader,
        )

    def _dispatch(self, data_loader) -> bool | None:
        """accelerate's ``dispatch_batches``, which it turns on by default for an ``IterableDataset``: process 0
        then reads one batch per *process* and hands each process its own, but a replica's TP/PP ranks then take
        their source rank's batch (above), so the batches of every other rank of a replica would be read and
        silently dropped (at TP 2, half the data). Under mtk an iterable dataset is instead sharded over the
        data-parallel replicas, each rank reading its replica's stream (the source's batch is the one used);
        asking for dispatch explicitly when tp x cp x pp > 1 is one line."""
        if self.parallel.dp_size == self.num_processes:  # every process is a replica: accelerate's way is right
            return self.dispatch_batches
        if self.dispatch_batches:
            raise ConfigError(
                "dispatch_batches=True hands each process its own batch, but with tp x cp x pp = "
                f"{self.num_processes // self.parallel.dp_size} the ranks of a model replica must train on one "
                "batch; leave dispatch_batches unset (mtk shards an iterable dataset over the data-parallel replicas)"
            )
        return False if isinstance(data_loader.dataset, IterableDataset) else self.dispatch_batches

    def _broadcasting(self, loader):
        """``loader`` whose batches come from the batch group's source rank (where tp x cp x pp > 1: CP's ranks
        split the source's rows, each of them its own positions), and which ends a stream read without dispatching
        (mtk's choice where a replica spans ranks) with its ``remainder``
        (:mod:`~mtk.integrations.accelerate.streams`)."""
        stream = self.parallel.dp_size != self.num_processes and isinstance(loader.dataset, IterableDataset)
        group = self.parallel.batch_group if self.parallel.dp_size != self.num_processes else None
        return broadcasting(loader, group, self.parallel.batch_src_rank, self.parallel.device, stream=stream)

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        """accelerate's; with tp x cp x pp > 1 the skipping loader, too, yields the source rank's batches."""
        return self._broadcasting(super().skip_first_batches(unwrapped(dataloader), num_batches))

    @contextmanager
    def accumulate(self, *models, sync: bool | None = None):
        """accelerate's ``accumulate``, also counting the data position that checkpoints record.

        ``sync``: whether this micro-batch ends the optimizer step, where the loop knows (:meth:`step_windows`);
        accelerate's own rule (every ``gradient_accumulation_steps``-th, and wherever the loader has ended)
        otherwise."""
        if sync is None:
            with super().accumulate(*models):
                yield
        else:
            self.step = 0 if sync else self.step + 1
            self.gradient_state._set_sync_gradients(sync)
            with contextlib.ExitStack() as stack:
                for model in models:  # DDP's no_sync until the step's last micro-batch
                    stack.enter_context(contextlib.nullcontext() if sync else self.no_sync(model))
                yield
        self.micro_batches_seen += 1
        if self.sync_gradients:
            self.completed_steps += 1

    def step_windows(self, dataloader) -> Iterator[StepWindow]:
        """The optimizer steps of a prepared ``dataloader`` from where this run is (after ``load_state``, where the
        checkpoint was), each with its micro-batches and their ``num_items_in_batch``
        (:func:`mtk.training.windows.step_windows`). Run each micro-batch under
        ``accumulate(model, sync=last)``."""
        return step_windows(
            dataloader,
            self.gradient_accumulation_steps,
            self.micro_batches_seen,
            lambda count: self.reduce(count.to(self.device), "sum"),
            self.parallel.dp_size,
            skip=self.skip_first_batches,
        )
