"""Preference pairs for DPO from a chat data set: the conversation's own last answer is chosen, another's rejected.

    python examples/make_preference_pairs.py data/pydocs.jsonl data/pydocs_pairs.jsonl

Each ``messages`` row becomes ``{"prompt": [...turns before the last answer], "chosen": [that answer], "rejected":
[the last answer of another conversation, drawn with --seed]}`` in TRL's conversational preference format. A model
that learnt the data prefers the on-topic answer: DPO's reward accuracy on held-out pairs made the same way shows
how often it does.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def pairs(conversations: list[list[dict]], seed: int) -> list[dict]:
    rng = random.Random(seed)
    answers = [chat[-1]["content"] for chat in conversations]
    rows = []
    for chat in conversations:
        if chat[-1]["role"] != "assistant":
            continue
        other = rng.choice([answer for answer in answers if answer != chat[-1]["content"]])
        rows.append(
            {
                "prompt": chat[:-1],
                "chosen": [chat[-1]],
                "rejected": [{"role": "assistant", "content": other}],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chats", type=Path, help="JSON lines with a 'messages' list each")
    parser.add_argument("out", type=Path, help="JSON lines with prompt, chosen, rejected")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    conversations = [json.loads(line)["messages"] for line in args.chats.read_text().splitlines() if line.strip()]
    rows = pairs(conversations, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {args.out} ({len(rows)} pairs)")


if __name__ == "__main__":
    main()
