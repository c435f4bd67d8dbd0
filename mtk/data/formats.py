"""Rows to training examples: ``input_ids`` and ``labels`` (-100 where no loss is wanted), with TRL's
SFT conventions for the columns.

- ``text``: causal LM on every token (an eos is appended).
- ``messages``: a conversation, a list of ``{"role", "content"}``, rendered by the tokenizer's own
  chat template; with ``loss_on="assistant"`` (the default) only the assistant turns carry labels.
- ``prompt`` + ``completion``: loss on the completion only (``loss_on="all"``: on both).

Tokenizing is one ``datasets.map(batched=True)`` (cached by ``datasets``, several processes on a big
corpus); examples longer than ``seq_len`` are truncated and counted, and examples left with no label
to learn from are dropped and counted (:class:`TokenizeReport`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from datasets import Dataset
from jinja2 import TemplateError

from mtk.errors import DataError

__all__ = ["IGNORE_INDEX", "LOSS_ON", "ROLES", "TokenizeReport", "detect_format", "tokenize_examples"]

IGNORE_INDEX = -100  # HF's (and torch's) label for "no loss here"
LOSS_ON = ("assistant", "all")
ROLES = ("system", "user", "assistant", "tool")
_PROC_ROWS = 20_000  # corpora at least this big are tokenized by several processes


@dataclass(frozen=True)
class TokenizeReport:
    """What tokenizing did: the format found, rows in, examples out, truncated and dropped rows."""

    format: str
    rows: int
    examples: int
    truncated: int
    dropped: int

    def describe(self, seq_len: int) -> str:
        text = f"{self.rows} rows of {self.format}"
        if self.truncated:
            text += f", {self.truncated} truncated to --seq_len {seq_len}"
        if self.dropped:
            text += f", {self.dropped} dropped (no token left to learn from)"
        return text


def detect_format(columns: list[str], source: str = "--data") -> str:
    """``text``, ``messages`` or ``prompt_completion``, from the columns (as TRL decides)."""
    if "messages" in columns:
        return "messages"
    if "prompt" in columns or "completion" in columns:
        if not {"prompt", "completion"} <= set(columns):
            raise DataError(f"{source} has columns {columns}: 'prompt' and 'completion' go together; give both")
        return "prompt_completion"
    if "text" in columns:
        return "text"
    raise DataError(
        f"{source} has columns {columns}; expected 'text', 'messages' (a list of {{role, content}}) "
        "or 'prompt' + 'completion'"
    )


def _encode(tokenizer: Any, text: str, *, first: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=first))


def _check_messages(messages: Any, row: int, source: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{source} row {row}: 'messages' must be a non-empty list of {{role, content}}")
    for turn in messages:
        if not isinstance(turn, dict) or not isinstance(turn.get("content"), str) or "role" not in turn:
            raise DataError(f"{source} row {row}: every message needs a 'role' and a string 'content', got {turn!r}")
        if turn["role"] not in ROLES:
            raise DataError(f"{source} row {row}: unknown role {turn['role']!r}; allowed: {', '.join(ROLES)}")


@contextlib.contextmanager
def chat_template_refusals(where: str) -> Iterator[None]:
    """A chat template's refusal (Jinja's sandbox, a template's ``raise_exception``) while ``where`` renders
    conversations itself (TRL's dataset preparation, generation): one line, not a traceback."""
    try:
        yield
    except TemplateError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(
            f"{where}: the tokenizer's chat template refuses a conversation ({first}); give a tokenizer whose "
            "template renders these conversations, or fix the rows"
        ) from None


def _render(tokenizer: Any, messages: list[dict], row: int, source: str, generation_prompt: bool = False) -> str:
    """The conversation through the tokenizer's chat template (transformers renders it in Jinja's sandbox); a
    template that refuses it (roles that must alternate, a first turn it does not allow) or that tries to leave
    the sandbox is one line naming the row."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except (TemplateError, ValueError) as err:  # ValueError: transformers' own refusals (an empty conversation)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(
            f"{source} row {row}: the tokenizer's chat template refuses this conversation ({first})"
        ) from None


def _conversation(tokenizer: Any, messages: list[dict], loss_on: str, row: int, source: str) -> tuple[list, list]:
    """Token ids of the rendered conversation and their labels (assistant turns only, or all).

    An assistant turn spans from the end of the conversation rendered up to it (with the generation
    prompt, which is the template's own assistant header) to the end of the conversation rendered
    through it; tokens are labelled by where their characters fall, so any template works as long as
    it renders a conversation prefix by prefix.
    """
    text = _render(tokenizer, messages, row, source)
    spans = []
    if loss_on == "assistant":
        for i, turn in enumerate(messages):
            if turn["role"] != "assistant":
                continue
            if i == 0:  # its start would be the rendering of no conversation, which templates refuse
                raise DataError(
                    f"{source} row {row}: the conversation starts with an assistant turn, whose tokens cannot be "
                    "located by rendering what comes before it; start it with a system or user turn, or use "
                    "--loss_on all"
                )
            start = _render(tokenizer, messages[:i], row, source, generation_prompt=True)
            end = _render(tokenizer, messages[: i + 1], row, source)
            if not (text.startswith(start) and text.startswith(end)):
                raise DataError(
                    f"{source} row {row}: the tokenizer's chat template does not render the conversation prefix by "
                    "prefix, so the assistant turns cannot be located; use --loss_on all"
                )
            spans.append((len(start), len(end)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    if loss_on == "all":
        return ids, list(ids)
    labels = [
        token if any(lo <= first < hi for lo, hi in spans) else IGNORE_INDEX
        for token, (first, _) in zip(ids, encoded["offset_mapping"], strict=True)
    ]
    return ids, labels


def _tokenize_batch(
    batch: dict[str, list], indices: list[int], *, tokenizer: Any, kind: str, seq_len: int, loss_on: str, source: str
) -> dict[str, list]:
    out: dict[str, list] = {"input_ids": [], "labels": [], "mtk_truncated": [], "mtk_learnable": []}
    for position, row in enumerate(indices):
        if kind == "text":
            text = batch["text"][position]
            if not isinstance(text, str):
                raise DataError(f"{source} row {row}: 'text' must be a string, got {text!r}")
            ids = _encode(tokenizer, text, first=True) + [tokenizer.eos_token_id]
            labels = list(ids)
        elif kind == "prompt_completion":
            prompt, completion = batch["prompt"][position], batch["completion"][position]
            if not isinstance(prompt, str) or not isinstance(completion, str):
                raise DataError(f"{source} row {row}: 'prompt' and 'completion' must be strings")
            prompt_ids = _encode(tokenizer, prompt, first=True)
            completion_ids = _encode(tokenizer, completion, first=False) + [tokenizer.eos_token_id]
            ids = prompt_ids + completion_ids
            labels = [IGNORE_INDEX] * len(prompt_ids) + completion_ids if loss_on == "assistant" else list(ids)
        else:
            messages = batch["messages"][position]
            _check_messages(messages, row, source)
            ids, labels = _conversation(tokenizer, messages, loss_on, row, source)
        out["mtk_truncated"].append(len(ids) > seq_len)
        ids, labels = ids[:seq_len], labels[:seq_len]
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["mtk_learnable"].append(any(label != IGNORE_INDEX for label in labels[1:]))  # HF shifts labels by one
    return out


def tokenize_examples(
    dataset: Dataset, tokenizer: Any, seq_len: int, *, loss_on: str = "assistant", source: str = "--data"
) -> tuple[Dataset, TokenizeReport]:
    """``input_ids`` + ``labels`` per example (at most ``seq_len`` tokens), and what it took."""
    if loss_on not in LOSS_ON:
        raise DataError(f"--loss_on {loss_on!r}: allowed {', '.join(LOSS_ON)}")
    kind = detect_format(dataset.column_names, source)
    if kind == "messages" and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{source} holds 'messages' but the tokenizer has no chat template; use a model directory whose "
            "tokenizer has one (tokenizer_config.json 'chat_template'), or give 'text' / 'prompt' + 'completion'"
        )
    if kind == "messages" and not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{source} holds 'messages': locating assistant turns needs a fast (tokenizers) tokenizer")
    if getattr(tokenizer, "eos_token_id", None) is None:
        raise DataError("the tokenizer has no eos token; set eos_token in its tokenizer_config.json")
    try:
        tokenized = dataset.map(
            _tokenize_batch,
            batched=True,
            with_indices=True,
            remove_columns=dataset.column_names,
            fn_kwargs=dict(tokenizer=tokenizer, kind=kind, seq_len=seq_len, loss_on=loss_on, source=source),
            num_proc=min(os.cpu_count() or 1, 8) if len(dataset) >= _PROC_ROWS else None,
            desc="tokenize",
        )
    except DataError:
        raise
    except Exception as err:  # a worker process wraps the DataError it raised
        cause: BaseException | None = err
        while cause is not None and not isinstance(cause, DataError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise DataError(str(cause)) from None
        raise
    truncated = sum(tokenized["mtk_truncated"])
    learnable = tokenized.filter(lambda flags: flags, input_columns="mtk_learnable", batched=False)
    dropped = len(tokenized) - len(learnable)
    if len(learnable) == 0 and kind == "text":  # (--loss_on masks nothing in plain text: its advice was no help)
        raise DataError(
            f"{source}: no row has a token to predict after its first (every 'text' is empty, or --seq_len "
            f"{seq_len} keeps one token); nothing to learn from: give rows with text"
        )
    if len(learnable) == 0:
        raise DataError(
            f"{source}: every example has its labels masked (loss on {loss_on}); nothing to learn from "
            "(check --loss_on, and that --seq_len keeps some of each completion)"
        )
    examples = learnable.remove_columns(["mtk_truncated", "mtk_learnable"])
    return examples, TokenizeReport(kind, len(dataset), len(examples), truncated, dropped)
