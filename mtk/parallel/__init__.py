"""Megatron-style tensor parallelism: topology, differentiable collectives, layers, loss, RNG."""

from mtk.parallel.comm import (
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
    scatter_to_tp,
)
from mtk.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from mtk.parallel.layout import Layout, LayoutError
from mtk.parallel.loss import vocab_parallel_cross_entropy
from mtk.parallel.random import TP_STREAM, RNGStreams, seed_everything_parallel
from mtk.parallel.state import ParallelState, default_device, init_distributed
from mtk.parallel.trace import count_collectives

__all__ = [
    "ColumnParallelLinear",
    "Layout",
    "LayoutError",
    "ParallelState",
    "RNGStreams",
    "RowParallelLinear",
    "TP_STREAM",
    "VocabParallelEmbedding",
    "copy_to_tp",
    "count_collectives",
    "default_device",
    "gather_from_sequence",
    "gather_from_tp",
    "init_distributed",
    "reduce_from_tp",
    "reduce_scatter_to_sequence",
    "scatter_to_sequence",
    "scatter_to_tp",
    "seed_everything_parallel",
    "vocab_parallel_cross_entropy",
]
