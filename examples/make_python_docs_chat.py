"""A chat data set from text every Python installation ships: the language reference topics of ``pydoc``.

    python examples/make_python_docs_chat.py data/python_docs_chat.jsonl

Each prose paragraph of ``pydoc_data.topics`` (the reference chapters ``help()`` shows: statements,
operators, data model) becomes a conversation: a system prompt, a question naming the topic, and an
answer in a fixed style, "Per the Python reference: <paragraph>", so a fine-tuned model is seen to have
learnt the style when it answers a new question. The last ``--eval`` conversations go to a second file
for ``--eval_data``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYSTEM = "You answer questions about Python in one paragraph."
STYLE = "Per the Python reference: "


def paragraphs(text: str) -> tuple[str, list[str]]:
    """The topic's title and its prose paragraphs (no grammar or code blocks, which are indented)."""
    lines = text.splitlines()
    title = lines[0].strip()
    prose = []
    for block in "\n".join(lines[2:]).split("\n\n"):
        block_lines = [line for line in block.splitlines() if line.strip()]
        if not block_lines or any(line.startswith(" ") for line in block_lines) or set(block.strip()) <= set("*=-"):
            continue
        paragraph = " ".join(line.strip() for line in block_lines)
        if 80 <= len(paragraph) <= 700:
            prose.append(paragraph)
    return title, prose


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", help="the .jsonl to write (the evaluation rows go to <output stem>_eval.jsonl)")
    parser.add_argument("--per_topic", type=int, default=4, help="paragraphs per reference topic (default 4)")
    parser.add_argument("--eval", type=int, default=32, help="conversations kept for evaluation (default 32)")
    args = parser.parse_args()
    from pydoc_data.topics import topics

    rows = []
    for key in sorted(topics):
        title, prose = paragraphs(topics[key])
        for i, paragraph in enumerate(prose[: args.per_topic]):
            question = f"What does the Python reference say about {title.lower()}?" + (f" (part {i + 1})" if i else "")
            rows.append(
                {
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": question},
                        {"role": "assistant", "content": STYLE + paragraph},
                    ]
                }
            )
    random.Random(0).shuffle(rows)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    train, evaluation = rows[: -args.eval], rows[-args.eval :]
    output.write_text("".join(json.dumps(row) + "\n" for row in train))
    eval_path = output.with_name(f"{output.stem}_eval.jsonl")
    eval_path.write_text("".join(json.dumps(row) + "\n" for row in evaluation))
    print(f"wrote {output} ({len(train)} conversations) and {eval_path} ({len(evaluation)})")


if __name__ == "__main__":
    main()
