"""mtk: Megatron-style tensor, pipeline and data parallelism for HuggingFace models.

Every name below is imported on first use (PEP 562): ``import mtk`` and the ``mtk`` command's start stay light
(torch, accelerate and transformers load only when something needs them), so a Ctrl-C while ``mtk`` starts ends in
its one line, not in a traceback from inside an import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mtk.config import ConfigError, ParallelConfig, RunSettings
    from mtk.convert.parallelize import parallelize
    from mtk.integrations.accelerate import Accelerator
    from mtk.parallel import (
        ColumnParallelLinear,
        Layout,
        LayoutError,
        ParallelState,
        RowParallelLinear,
        VocabParallelEmbedding,
        vocab_parallel_cross_entropy,
    )
    from mtk.parallel.record import parallelized

__version__ = "0.1.0"

_HOMES = {
    "Accelerator": "mtk.integrations.accelerate",
    "ColumnParallelLinear": "mtk.parallel",
    "ConfigError": "mtk.config",
    "Layout": "mtk.parallel",
    "LayoutError": "mtk.parallel",
    "ParallelConfig": "mtk.config",
    "ParallelState": "mtk.parallel",
    "RowParallelLinear": "mtk.parallel",
    "RunSettings": "mtk.config",
    "VocabParallelEmbedding": "mtk.parallel",
    "parallelize": "mtk.convert.parallelize",
    "parallelized": "mtk.parallel.record",
    "vocab_parallel_cross_entropy": "mtk.parallel",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'mtk' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


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
