"""mtk: Megatron-style tensor, pipeline and data parallelism for HuggingFace models."""

from mtk.config import ConfigError, ParallelConfig
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

__all__ = [
    "ColumnParallelLinear",
    "ConfigError",
    "Layout",
    "LayoutError",
    "ParallelConfig",
    "ParallelState",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "__version__",
    "vocab_parallel_cross_entropy",
]
