"""Engines mtk plugs into: accelerate (here) and DeepSpeed."""
