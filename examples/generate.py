"""Answer one chat message with a model directory (e.g. what ``mtk export`` wrote), greedily.

    python examples/generate.py ckpts/hf --prompt "What does the Python reference say about the pass statement?"

Plain transformers: ``from_pretrained``, the tokenizer's chat template with the generation prompt,
``generate``. ``--system`` adds a system message first. A directory it cannot use is one line (through mtk's
``run_main``, as every example), not transformers' traceback.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C while the libraries below load (seconds): stop quietly, not their traceback
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)  # (run_main says it in one line from then on)

import argparse
from pathlib import Path

from mtk.args import ArgumentParser, positive_int, utf8_text
from mtk.checkpoint.hf_load import safetensors_index
from mtk.checkpoint.safetensors_slices import open_safetensors
from mtk.data.formats import chat_template_refusals
from mtk.data.tokenizers import directory_tokenizer
from mtk.errors import CheckpointError, DataError
from mtk.models import ModelSpecError, causal_lm_refusal, resolve_config
from mtk.training.entry import run_main


def check_model_directory(directory: str) -> None:
    """What transformers would refuse in a traceback, as one line: no such directory, an mtk training checkpoint
    (export it first), a config that needs custom code or weights that are only pickles, a model that is not a
    causal LM (transformers would generate from a randomly initialized head, exit 0)."""
    path = Path(directory)
    if (path / "metadata.json").is_file():
        raise CheckpointError(f"{path} is an mtk training checkpoint; export it first: mtk export {path} <out_dir>")
    if not (path / "config.json").is_file():  # (built-in configs have no weights nor tokenizer to answer with)
        raise ModelSpecError(
            f"model {directory!r} is not a model directory (no config.json there); give a local HF directory with "
            "weights and a tokenizer, e.g. what mtk export wrote"
        )
    refusal = causal_lm_refusal(resolve_config(str(path)))  # (custom code, pickle-only weights: one line)
    if refusal:
        raise ModelSpecError(f"{path}: {refusal}; give the directory of a causal language model (a decoder)")


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a local HF directory with a tokenizer that has a chat template")
    parser.add_argument("--prompt", required=True, type=utf8_text, help="the user message")
    parser.add_argument("--system", type=utf8_text, help="a system message before it")
    parser.add_argument("--max_new_tokens", type=positive_int, default=80, help="tokens to generate (80)")
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    check_model_directory(args.model)
    tokenizer = directory_tokenizer(args.model, "model")  # none there, or one that needs custom code: one line
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{args.model}'s tokenizer has no chat template; give a directory whose tokenizer has one")
    for weights in set(safetensors_index(args.model).values()):  # (truncated: safetensors' traceback in loading)
        with open_safetensors(weights):
            pass
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, use_safetensors=True).eval()
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    with chat_template_refusals(f"{args.model}'s tokenizer"):
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    prompt_tokens = inputs["input_ids"].shape[1]
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and prompt_tokens + args.max_new_tokens > positions:
        room = positions - prompt_tokens
        advice = f"use --max_new_tokens {room} or fewer" if room > 0 else "give a shorter prompt (or --system)"
        raise DataError(  # (transformers only warns, and generates past them until stopped)
            f"--max_new_tokens {args.max_new_tokens} after the prompt's {prompt_tokens} tokens goes past the model's "
            f"{positions} positions (max_position_embeddings); {advice}"
        )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    print(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip())


if __name__ == "__main__":
    run_main(main, "generate.py")
