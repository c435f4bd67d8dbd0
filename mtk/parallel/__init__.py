"""Megatron-style tensor parallelism: topology, differentiable collectives, layers, loss, RNG."""

from mtk.parallel.collective_count import count_collectives
from mtk.parallel.comm import (
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
    scatter_to_tp,
)
from mtk.parallel.embedding import VocabParallelEmbedding, padded_vocab_size
from mtk.parallel.grads import share_params_across_tp, sync_sequence_parallel_grads
from mtk.parallel.layers import ColumnParallelLinear, KVReplicatedColumnLinear, RowParallelLinear
from mtk.parallel.layout import Layout, LayoutError
from mtk.parallel.loss import vocab_parallel_cross_entropy
from mtk.parallel.parameters import ParamInfo, param_info, set_param_info
from mtk.parallel.random import TP_STREAM, RNGStreams, seed_everything_parallel
from mtk.parallel.sharding import ShardSpec
from mtk.parallel.state import ParallelState, default_device, init_distributed

__all__ = [
    "ColumnParallelLinear",
    "KVReplicatedColumnLinear",
    "Layout",
    "LayoutError",
    "ParallelState",
    "ParamInfo",
    "RNGStreams",
    "RowParallelLinear",
    "ShardSpec",
    "TP_STREAM",
    "VocabParallelEmbedding",
    "copy_to_tp",
    "count_collectives",
    "default_device",
    "gather_from_sequence",
    "gather_from_tp",
    "init_distributed",
    "padded_vocab_size",
    "param_info",
    "reduce_from_tp",
    "reduce_scatter_to_sequence",
    "scatter_to_sequence",
    "scatter_to_tp",
    "seed_everything_parallel",
    "set_param_info",
    "share_params_across_tp",
    "sync_sequence_parallel_grads",
    "vocab_parallel_cross_entropy",
]
