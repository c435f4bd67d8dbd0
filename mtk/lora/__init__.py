"""LoRA adapters on mtk's tensor/pipeline-parallel models, through PEFT (docs/lora.md)."""

from mtk.lora.initial import load_full_adapters, peft_initial_adapters
from mtk.lora.model import get_peft_model, hf_model, is_peft_model, split_linear_names

__all__ = [
    "get_peft_model",
    "hf_model",
    "is_peft_model",
    "load_full_adapters",
    "peft_initial_adapters",
    "split_linear_names",
]
