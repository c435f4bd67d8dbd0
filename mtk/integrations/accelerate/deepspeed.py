"""What mtk.Accelerator changes in accelerate's DeepSpeed path (``distributed_type: DEEPSPEED``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from accelerate.scheduler import AcceleratedScheduler

from mtk.integrations.accelerate.scheduler import DataParallelScheduler
from mtk.parallel.state import ParallelState

__all__ = ["deepspeed_initialize_with_mpu", "replace_accelerated_schedulers"]


@contextmanager
def deepspeed_initialize_with_mpu(parallel: ParallelState) -> Iterator[None]:
    """accelerate calls ``deepspeed.initialize`` without an mpu and counts every process as a data
    replica in ``train_batch_size``; with mtk's topology as the mpu ZeRO shards over the DP group
    only, and the global batch is micro-batch x accumulation x DP."""
    import deepspeed

    original = deepspeed.initialize

    def initialize(*args, **kwargs):
        config = kwargs.get("config_params") or kwargs.get("config")
        if isinstance(config, dict) and "train_micro_batch_size_per_gpu" in config:
            micro, accumulation = (
                config["train_micro_batch_size_per_gpu"],
                config.get("gradient_accumulation_steps", 1),
            )
            config["train_batch_size"] = micro * accumulation * parallel.dp_size
            config.pop("mtk", None)
        kwargs["mpu"] = parallel
        return original(*args, **kwargs)

    deepspeed.initialize = initialize
    try:
        yield
    finally:
        deepspeed.initialize = original


def replace_accelerated_schedulers(accelerator, prepared):
    """A torch scheduler DeepSpeed does not own is stepped by accelerate once per process; under TP
    it must step once per DP replica, as everywhere else in mtk."""
    single = not isinstance(prepared, tuple)
    items = [prepared] if single else list(prepared)
    for i, obj in enumerate(items):
        if type(obj) is AcceleratedScheduler:
            replacement = DataParallelScheduler(
                obj.scheduler,
                obj.optimizers,
                step_with_optimizer=obj.step_with_optimizer,
                split_batches=obj.split_batches,
                dp_size=accelerator.parallel.dp_size,
            )
            accelerator._schedulers = [replacement if s is obj else s for s in accelerator._schedulers]
            items[i] = replacement
    return items[0] if single else tuple(items)
