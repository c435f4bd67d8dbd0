"""Checkpoints: loading HF directories shard by shard (and, later, saving, resharding, export)."""

from mtk.checkpoint.hf_load import CheckpointError, load_pretrained_tp, safetensors_index

__all__ = ["CheckpointError", "load_pretrained_tp", "safetensors_index"]
