"""Checkpoints: HF directories read slice by slice, and mtk's sharded training checkpoints.

``hf_load`` builds a TP/PP model from a local HF directory; ``sharded`` saves and loads ``step_N/``
(its parts: ``paths``, ``meta``, ``weights``, ``optimizer``, ``rng``, ``atomic``); ``reader`` merges
the shards of any layout; ``export`` writes an HF directory from them.
"""

from mtk.checkpoint.hf_load import load_pretrained_tp, safetensors_index
from mtk.checkpoint.meta import CheckpointMeta, read_metadata
from mtk.checkpoint.paths import CheckpointPaths
from mtk.errors import CheckpointError

__all__ = [
    "CheckpointError",
    "CheckpointMeta",
    "CheckpointPaths",
    "load_pretrained_tp",
    "read_metadata",
    "safetensors_index",
]
