"""Answer one chat message with a model directory (e.g. what ``mtk export`` wrote), greedily.

    python examples/generate.py ckpts/hf --prompt "What does the Python reference say about the pass statement?"

Plain transformers: ``from_pretrained``, the tokenizer's chat template with the generation prompt,
``generate``. ``--system`` adds a system message first.
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a local HF directory with a tokenizer that has a chat template")
    parser.add_argument("--prompt", required=True, help="the user message")
    parser.add_argument("--system", help="a system message before it")
    parser.add_argument("--max_new_tokens", type=int, default=80)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, use_safetensors=True).eval()
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    print(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip())


if __name__ == "__main__":
    main()
