"""The LR scheduler wrapper mtk.Accelerator uses: one step per data-parallel replica, not per process."""

from __future__ import annotations

from accelerate.scheduler import AcceleratedScheduler

__all__ = ["DataParallelScheduler"]


class DataParallelScheduler(AcceleratedScheduler):
    """accelerate steps the LR scheduler once per *process* per optimizer step (each process is a
    replica that multiplied the batch); under TP/PP only the data-parallel replicas do."""

    def __init__(self, *args, dp_size: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dp_size = dp_size

    def step(self, *args, **kwargs) -> None:
        if not self.step_with_optimizer or self.split_batches or not self.gradient_state.sync_gradients:
            return super().step(*args, **kwargs)
        if any(opt.step_was_skipped for opt in self.optimizers):
            return None
        for _ in range(self.dp_size):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR must not run past its end
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)
        return None
