"""Runs shared by the e2e tests, launched once per test session (once per worker under ``-n``).

The deterministic reference runs (the built-in tiny Llama on the bundled data, seed 0) are what many
tests compare against: at TP=1 and TP=2, 6 steps, checkpoints at steps 3 and 6. Tests read their
directories (resume, export, reshard) but never write into them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.launch import finetune


@dataclass(frozen=True)
class Run:
    """A finished training run: its output directory (``step_3``, ``step_6``, ``runs``) and losses."""

    dir: Path
    losses: dict[int, float]


def _reference(tmp_path_factory, config: str) -> Run:
    out_dir = tmp_path_factory.mktemp(config)
    return Run(out_dir, finetune(config, out_dir, "--max_steps", "6", "--save_every", "3"))


@pytest.fixture(scope="session")
def llama_tp1(tmp_path_factory) -> Run:
    """The single-process reference every layout must reproduce."""
    return _reference(tmp_path_factory, "tp1")


@pytest.fixture(scope="session")
def llama_tp2(tmp_path_factory) -> Run:
    """The same run at TP=2 (the README's main command, shortened)."""
    return _reference(tmp_path_factory, "tp2")


@dataclass(frozen=True)
class ChatSetup:
    """A local model directory (tiny Llama + a BPE tokenizer with a ChatML template) and chat data."""

    model: Path
    data: Path
    eval_data: Path


def chat_conversations(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Conversations whose lengths vary more than 10x: one-line exchanges, long multi-turn ones, and long
    prompts with one-word answers (micro-batches that are nearly all masked)."""
    import json
    import random

    sample = Path(__file__).parents[2] / "examples" / "data" / "sample.jsonl"
    sentences = [json.loads(line)["text"] for line in sample.open()]
    rng = random.Random(seed)
    conversations = []
    for i in range(count):
        kind = i % 3
        if kind == 0:  # short
            turns = [("user", rng.choice(sentences)), ("assistant", rng.choice(sentences).split()[0])]
        elif kind == 1:  # long, several turns
            turns = [("system", "Answer in the style of a farm diary.")]
            for _ in range(rng.randint(2, 4)):
                turns += [("user", rng.choice(sentences)), ("assistant", " ".join(rng.sample(sentences, 3)))]
        else:  # a long prompt, a one-word answer
            turns = [("user", " ".join(rng.sample(sentences, 6))), ("assistant", "Yes.")]
        conversations.append([{"role": role, "content": content} for role, content in turns])
    return conversations


def save_chat_model(name: str, tokenizer, directory: Path) -> Path:
    """Built-in model ``name`` sized to ``tokenizer``'s vocabulary and special ids (seed 0), saved with the tokenizer
    into ``directory``: a local HF directory as TRL's scripts take it."""
    import torch
    from transformers import AutoModelForCausalLM

    from mtk.models import builtin_config

    config = builtin_config(name)
    config.update(
        dict(
            vocab_size=len(tokenizer),
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def chat_setup(tmp_path_factory) -> ChatSetup:
    import json

    from mtk.testing import train_chat_tokenizer

    root = tmp_path_factory.mktemp("chat")
    conversations = chat_conversations(240)
    tokenizer = train_chat_tokenizer([turn["content"] for chat in conversations for turn in chat])
    save_chat_model("tiny-llama", tokenizer, root / "model")
    data, eval_data = root / "chat.jsonl", root / "chat_eval.jsonl"
    data.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in conversations))
    eval_data.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chat_conversations(30, seed=1)))
    return ChatSetup(root / "model", data, eval_data)
