"""accelerate made TP/PP/DP-aware: :class:`Accelerator` and the pieces it is built from (one module per concern)."""

from mtk.integrations.accelerate.accelerator import Accelerator, DataParallelScheduler

__all__ = ["Accelerator", "DataParallelScheduler"]
