"""mtk: Megatron-style tensor, pipeline and data parallelism for HuggingFace models."""

from mtk.config import ConfigError, ParallelConfig, RunSettings
from mtk.parallel import (
    ColumnParallelLinear,
    Layout,
    LayoutError,
    ParallelState,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

__version__ = "0.1.0"


def __getattr__(name: str):
    # The Accelerator pulls in accelerate and transformers: import it on first use, so `import mtk`
    # and `mtk --help` stay fast.
    if name == "Accelerator":
        from mtk.integrations.accelerate import Accelerator

        return Accelerator
    if name in ("parallelize", "parallelized"):
        import mtk.convert as module

        return getattr(module, name)
    raise AttributeError(f"module 'mtk' has no attribute {name!r}")


__all__ = [
    "Accelerator",
    "ColumnParallelLinear",
    "ConfigError",
    "Layout",
    "LayoutError",
    "ParallelConfig",
    "ParallelState",
    "RowParallelLinear",
    "RunSettings",
    "VocabParallelEmbedding",
    "__version__",
    "parallelize",
    "parallelized",
    "vocab_parallel_cross_entropy",
]
