"""Chat/instruction data: every format, prompt masking, packing (exact against unpacked), padding, and bad
input as one line. A BPE tokenizer with a ChatML template is trained here in a second: no download."""

import copy
import gzip
import json
import os
import re
import shutil

import pytest
import torch
from datasets import Dataset

from mtk.data import (
    IGNORE_INDEX,
    ByteTokenizer,
    PadToLongest,
    load_data,
    loss_tokens,
    pack,
    tokenize_examples,
    tokenizer_for,
    training_data,
)
from mtk.errors import DataError
from mtk.models import builtin_config
from mtk.testing import assert_close_rel, train_chat_tokenizer

TEXTS = [
    "The baker cleans the river after the rain.",
    "Our neighbor cleans a wooden bridge before dinner.",
    "Where is the red barn? It is near the river, past the old bridge.",
]
CHAT = [
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Where is the barn?"},
        {"role": "assistant", "content": "Near the river."},
        {"role": "user", "content": "And the bridge?"},
        {"role": "assistant", "content": "Past the barn."},
    ],
    [{"role": "user", "content": "Who cleans the river?"}, {"role": "assistant", "content": "The baker."}],
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_chat_tokenizer(TEXTS * 20 + [m["content"] for chat in CHAT for m in chat] * 20)


def _labelled(tokenizer, example) -> str:
    return tokenizer.decode([t for t in example["labels"] if t != IGNORE_INDEX])


def test_text_trains_on_every_token_and_ends_with_eos(tokenizer):
    examples, report = tokenize_examples(Dataset.from_dict({"text": TEXTS}), tokenizer, 256)
    assert report.format == "text" and report.examples == 3 and report.truncated == report.dropped == 0
    first = examples[0]
    assert first["labels"] == first["input_ids"] and first["input_ids"][-1] == tokenizer.eos_token_id
    assert tokenizer.decode(first["input_ids"], skip_special_tokens=True) == TEXTS[0]


def test_prompt_completion_masks_the_prompt(tokenizer):
    rows = Dataset.from_dict({"prompt": ["Where is the barn? "], "completion": ["Near the river."]})
    (example,), _ = tokenize_examples(rows, tokenizer, 256)
    assert _labelled(tokenizer, example) == "Near the river.<|endoftext|>"
    prompt_length = len(tokenizer.encode("Where is the barn? "))
    assert example["labels"][:prompt_length] == [IGNORE_INDEX] * prompt_length
    (everything,), _ = tokenize_examples(rows, tokenizer, 256, loss_on="all")
    assert everything["labels"] == everything["input_ids"]


def test_messages_use_the_chat_template_and_learn_only_assistant_turns(tokenizer):
    examples, report = tokenize_examples(Dataset.from_list([{"messages": chat} for chat in CHAT]), tokenizer, 256)
    assert report.format == "messages"
    first = examples[0]
    assert tokenizer.decode(first["input_ids"]) == tokenizer.apply_chat_template(CHAT[0], tokenize=False)
    assert _labelled(tokenizer, first) == "Near the river.<|im_end|>\nPast the barn.<|im_end|>\n"
    all_tokens, _ = tokenize_examples(Dataset.from_list([{"messages": CHAT[1]}]), tokenizer, 256, loss_on="all")
    assert all_tokens[0]["labels"] == all_tokens[0]["input_ids"]


def test_long_examples_are_truncated_and_unlearnable_ones_dropped_and_counted(tokenizer):
    rows = Dataset.from_dict({"prompt": ["Where is the barn? " * 10, "Hi "], "completion": ["Near.", "Near."]})
    examples, report = tokenize_examples(rows, tokenizer, 12)
    assert (report.rows, report.examples, report.truncated, report.dropped) == (2, 1, 1, 1)
    assert "1 truncated to --seq_len 12, 1 dropped" in report.describe(12)
    assert all(len(ids) <= 12 for ids in examples["input_ids"])


@pytest.mark.parametrize(
    "rows, message",
    [
        ({"body": ["x"]}, "has columns ['body']; expected 'text', 'messages'"),
        ({"prompt": ["x"]}, "'prompt' and 'completion' go together"),
        ({"messages": [[{"role": "wizard", "content": "hi"}]]}, "row 0: unknown role 'wizard'; allowed: system"),
        ({"messages": [[{"role": "user"}]]}, "row 0: every message needs a 'role' and a string 'content'"),
        ({"messages": [[]]}, "row 0: 'messages' must be a non-empty list"),
        ({"text": [None]}, "row 0: 'text' must be a string"),
        ({"messages": [[{"role": "user", "content": "no answer"}]]}, "every example has its labels masked"),
        ({"text": ["", ""]}, "no row has a token to predict after its first"),  # (--loss_on)
    ],
    ids=[
        "no-known-column",
        "prompt-alone",
        "unknown-role",
        "no-content",
        "empty-chat",
        "null-text",
        "all-masked",
        "empty-texts",
    ],  # fmt: skip
)
def test_bad_rows_are_one_line(tokenizer, rows, message):
    with pytest.raises(DataError, match=message.replace("?", r"\?").replace("[", r"\[").replace("]", r"\]")):
        tokenize_examples(Dataset.from_dict(rows), tokenizer, 64)


def test_messages_need_a_chat_template():
    with pytest.raises(DataError, match="holds 'messages' but the tokenizer has no chat template"):
        tokenize_examples(Dataset.from_list([{"messages": CHAT[1]}]), ByteTokenizer(), 64)


def test_local_sources_folder_parquet_and_save_to_disk(tmp_path, capsys):
    folder = tmp_path / "shards"
    folder.mkdir()
    for i, text in enumerate(TEXTS):
        (folder / f"part{i}.jsonl").write_text(json.dumps({"text": text}) + "\n")
    assert load_data(folder)["text"] == TEXTS
    Dataset.from_dict({"text": TEXTS}).to_parquet(str(tmp_path / "data.parquet"))
    assert load_data(tmp_path / "data.parquet")["text"] == TEXTS
    Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "saved"))
    assert load_data(tmp_path / "saved")["text"] == TEXTS
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{broken\n')
    with pytest.raises(DataError, match="could not be read as json"):
        load_data(bad)
    assert "Failed to load JSON" not in capsys.readouterr().err, "datasets' own ERROR line is not repeated"


def test_a_folder_that_cannot_be_read_names_the_file(tmp_path):
    """datasets reads a folder as one table and says only "Couldn't cast" of files whose columns differ: the line
    names the file that differs from the first, or the one that cannot be read alone."""
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"text": TEXTS[0]}) + "\n")
    (folder / "b.jsonl").write_text(json.dumps({"text": 5, "label": 1}) + "\n")
    with pytest.raises(DataError, match="b.jsonl has columns .*'label'.*, a.jsonl has .*give files of one schema"):
        load_data(folder)
    (folder / "b.jsonl").write_text('{"text": "fine"}\n{broken\n')
    with pytest.raises(DataError, match=r"could not be read as json \(b.jsonl line 2, column 2: Expecting property"):
        load_data(folder)
    # a key given twice: Python's reader keeps the last, pyarrow's said "Trailing data at position 31"
    (folder / "b.jsonl").write_text('{"text": "fine"}\n{"text": "a b c", "text": "d e f"}\n')
    with pytest.raises(DataError, match=r"could not be read as json \(b.jsonl line 2: key 'text' is given twice\)"):
        load_data(folder)


def test_a_compression_whose_package_is_missing_says_to_install_it(tmp_path, monkeypatch):
    """datasets reads .zst and .lz4 files only with packages it does not depend on, and says "Compression type zstd
    not supported" without them, which reads as a broken file."""
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "zstandard" else found(name))
    (tmp_path / "rows.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    with pytest.raises(DataError, match="rows.jsonl.zst is zst-compressed, .* pip install zstandard"):
        load_data(tmp_path / "rows.jsonl.zst")


def test_bytes_that_are_not_utf8_are_one_line_naming_the_row(tmp_path):
    for name, data in (("bad.jsonl", b'{"text": "ok"}\n{"text": "\xff"}\n'), ("bad.txt", b"ok\n\xff\xfe\n")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError, match="is not UTF-8|could not be read as text .*utf-8"):
            load_data(tmp_path / name)
    with pytest.raises(DataError, match="bad.jsonl row 1 is not UTF-8 text"):
        load_data(tmp_path / "bad.jsonl")


def test_a_folder_skips_no_file_without_a_word(tmp_path):
    """Suffixes in any case and compressed files are read; any other file (but a hidden one) is one line."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"text": TEXTS[0]}) + "\n")
    (folder / "B.JSONL").write_text(json.dumps({"text": TEXTS[1]}) + "\n")
    (folder / "c.jsonl.gz").write_bytes(gzip.compress((json.dumps({"text": TEXTS[2]}) + "\n").encode()))
    (folder / ".DS_Store").write_bytes(b"\0")
    assert sorted(load_data(folder)["text"]) == sorted(TEXTS[:3])
    (folder / "notes.md").write_text("# not data")
    with pytest.raises(DataError, match="holds 'notes.md', which is not a data file"):
        load_data(folder)
    (folder / "notes.md").unlink()
    (folder / "more").mkdir()  # a shard folder inside: its rows were dropped without a word
    (folder / "more" / "d.jsonl").write_text(json.dumps({"text": TEXTS[0]}) + "\n")
    with pytest.raises(DataError, match="holds the folder 'more', whose files would not be read"):
        load_data(folder)
    shutil.rmtree(folder / "more")
    for name, make in (("gone.jsonl", lambda p: p.symlink_to(tmp_path / "nowhere.jsonl")), ("pipe.jsonl", os.mkfifo)):
        make(folder / name)  # a link whose file is gone, a named pipe: their rows were skipped without a word
        with pytest.raises(DataError, match=f"holds '{name}', which is not a readable regular file"):
            load_data(folder)
        (folder / name).unlink()


def test_packing_restarts_positions_and_masks_each_example_start(tokenizer):
    examples, _ = tokenize_examples(Dataset.from_dict({"text": TEXTS}), tokenizer, 64)
    lengths = [len(ids) for ids in examples["input_ids"]]
    rows = pack(examples, 64, tokenizer.pad_token_id)
    assert len(rows) == 1 and rows[0]["input_ids"].shape == (64,)
    positions, labels = rows[0]["position_ids"].tolist(), rows[0]["labels"].tolist()
    start = 0
    for length, example in zip(lengths, examples, strict=True):
        assert positions[start : start + length] == list(range(length))
        assert labels[start] == IGNORE_INDEX and labels[start + 1 : start + length] == example["labels"][1:]
        start += length
    assert labels[start:] == [IGNORE_INDEX] * (64 - start) and positions[start:] == list(range(64 - start))
    assert loss_tokens(PadToLongest(3)([rows[0]])) == sum(length - 1 for length in lengths)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_logits_equal_each_example_alone(tokenizer, family):
    """transformers builds the block-diagonal mask from the restarting position ids: no token sees another example."""
    from transformers import AutoModelForCausalLM

    config = builtin_config(f"tiny-{family}")
    config.vocab_size = len(tokenizer)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    examples, _ = tokenize_examples(Dataset.from_dict({"text": TEXTS}), tokenizer, 64)
    row = pack(examples, 64, tokenizer.pad_token_id)[0]
    with torch.no_grad():
        # no KV cache (as in training): transformers detects packing only without one
        packed = model(input_ids=row["input_ids"][None], position_ids=row["position_ids"][None], use_cache=False)
        packed = packed.logits[0]  # [64, V]
        start = 0
        for ids in examples["input_ids"]:
            alone = model(input_ids=torch.tensor([ids])).logits[0]  # [len, V]
            assert_close_rel(packed[start : start + len(ids)], alone, f"{family} example at {start}")
            start += len(ids)


def test_padding_to_the_longest_with_an_attention_mask(tokenizer):
    examples, _ = tokenize_examples(Dataset.from_dict({"text": TEXTS}), tokenizer, 64)
    batch = PadToLongest(tokenizer.pad_token_id)([examples[0], examples[2]])
    short, long = len(examples[0]["input_ids"]), len(examples[2]["input_ids"])
    assert batch["input_ids"].shape == (2, long) and batch["attention_mask"][0].tolist() == [1] * short + [0] * (
        long - short
    )
    assert batch["labels"][0, short:].eq(IGNORE_INDEX).all()
    assert loss_tokens(batch) == short - 1 + long - 1


def test_training_data_end_to_end(tokenizer, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHAT))
    dataset, collate, report = training_data(path, tokenizer, 128, packing=True)
    assert report.examples == 2 and len(dataset) == 1 and collate.pad_id == tokenizer.pad_token_id


def test_eval_batches_give_each_replica_whole_batches_and_count_every_example_once(tokenizer):
    from mtk.data import eval_batches

    examples, _ = tokenize_examples(Dataset.from_dict({"text": TEXTS + TEXTS[:2]}), tokenizer, 64)  # 5 examples
    collate = PadToLongest(tokenizer.pad_token_id)
    replicas = [eval_batches(examples, collate, 2, rank, 2) for rank in range(2)]
    assert [len(batches) for batches in replicas] == [2, 2]  # 3 and 2 examples, filled up to 2 batches of 2
    assert all(batch["input_ids"].shape[0] == 2 for batches in replicas for batch in batches)
    counted = sum(loss_tokens(batch) for batches in replicas for batch in batches)
    assert counted == sum(len(ids) - 1 for ids in examples["input_ids"]), "fillers add no token"


def test_evaluate_is_the_token_mean_of_one_process(tokenizer):
    from transformers import AutoModelForCausalLM

    from mtk.data import eval_batches
    from mtk.training.evaluation import evaluate

    config = builtin_config("tiny-llama")
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    examples, _ = tokenize_examples(Dataset.from_dict({"text": TEXTS + TEXTS[:2]}), tokenizer, 64)
    collate = PadToLongest(tokenizer.pad_token_id)
    scores = evaluate(model, eval_batches(examples, collate, 2, 0, 1), torch.device("cpu"), lambda t: t)
    whole = collate([examples[i] for i in range(len(examples))])
    with torch.no_grad():
        expected = model(**whole, use_cache=False).loss.item()  # HF's mean over every labelled token
    assert_close_rel(torch.tensor(scores["eval/loss"]), torch.tensor(expected), "eval loss")
    assert model.training, "evaluate leaves the model as it found it"


def test_a_model_directory_without_a_tokenizer_is_refused_unless_one_is_named(tmp_path):
    """Falling back to bytes would train a real model on byte ids without a word: a directory without tokenizer
    files needs --tokenizer (a directory, or bytes); bytes on a vocabulary too small for its ids is refused too."""
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(DataError, match="has no tokenizer .*pass --tokenizer DIR .* or --tokenizer bytes"):
        tokenizer_for(str(model))
    assert isinstance(tokenizer_for(str(model), "bytes", vocab_size=259), ByteTokenizer)
    with pytest.raises(DataError, match="ids go up to 258 but the model has 100 embeddings"):
        tokenizer_for(str(model), "bytes", vocab_size=100)
    with pytest.raises(DataError, match="--tokenizer nowhere is not a directory"):
        tokenizer_for(str(model), "nowhere")
    assert isinstance(tokenizer_for("tiny-llama"), ByteTokenizer), "built-in configs are made for bytes"
    ByteTokenizer().save_pretrained(model)  # a saved byte-tokenizer model names its tokenizer
    assert isinstance(tokenizer_for(str(model)), ByteTokenizer)


def test_a_tokenizer_that_needs_code_cannot_load_or_outgrows_the_model_is_one_line(tmp_path, tokenizer):
    """AutoTokenizer refused these in a traceback (custom code: not run, but not one line either); a tokenizer with
    more ids than the model has embeddings trained silently under TP (an id past the shards reads zeros)."""
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["evil.T", None]}}))
    (custom / "evil.py").write_text("raise SystemExit('ran')\n")
    with pytest.raises(DataError, match="needs the custom code its auto_map names"):
        tokenizer_for("tiny-llama", str(custom))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "NoSuchTokenizerFast"}))
    with pytest.raises(DataError, match="transformers cannot load its tokenizer"):
        tokenizer_for("tiny-llama", str(broken))
    tokenizer.save_pretrained(tmp_path / "real")
    assert tokenizer_for("tiny-llama", str(tmp_path / "real"), vocab_size=len(tokenizer)) is not None
    with pytest.raises(DataError, match=f"its tokenizer has {len(tokenizer)} ids but the model has 8 embeddings"):
        tokenizer_for("tiny-llama", str(tmp_path / "real"), vocab_size=8)


@pytest.mark.parametrize(
    "template, message",
    [
        ("{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('Conversation must start with the user') }}"
         "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}", "row 0: the tokenizer's chat template "
         "refuses this conversation (Conversation must start with the user)"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "row 0: the tokenizer's chat template refuses this"),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "row 0: the conversation starts with an assistant "
         "turn"),  # a template that takes it: its start cannot be rendered (no conversation before it)
    ],
    ids=["refused-by-the-template", "escaping-the-sandbox", "assistant-first"],
)  # fmt: skip
def test_a_chat_template_that_refuses_a_row_is_one_line_naming_it(tokenizer, template, message):
    """transformers renders templates in Jinja's sandbox: its refusals (a template's raise_exception, an attribute
    the sandbox forbids) are one line naming the row, not a traceback."""
    chat = copy.copy(tokenizer)
    chat.chat_template = template
    rows = Dataset.from_list(
        [{"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]}]
    )
    with pytest.raises(DataError, match=re.escape(message)):
        tokenize_examples(rows, chat, 64)


def test_a_template_refusal_where_trl_or_generation_renders_is_one_line(tokenizer):
    """TRL's trainers and generate.py render conversations themselves: the sandbox's refusal is one line there too
    (mtk.trainers.trl wraps SFTTrainer's and DPOTrainer's data preparation in it)."""
    from mtk.data.formats import chat_template_refusals

    chat = copy.copy(tokenizer)
    chat.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(DataError, match=r"^SFTTrainer's data: the tokenizer's chat template refuses a conversation"):
        with chat_template_refusals("SFTTrainer's data"):
            chat.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_a_csv_text_column_is_text_whatever_its_cells_look_like(tmp_path):
    """A CSV has no types and no null: an empty text cell was read as None and refused ("'text' must be a string,
    got None") where {"text": ""} in JSON lines trains, a text column of numbers was read as integers, and the words
    pandas takes for missing values ("NA", "None") as None. All are text; the label column keeps its type."""
    (tmp_path / "rows.csv").write_text('text,label\nhello,1\n,0\n42,1\n"",0\nNA,1\nNone,0\nnull,\n')
    rows = load_data(tmp_path / "rows.csv")
    assert rows["text"] == ["hello", "", "42", "", "NA", "None", "null"]  # (pandas read the last three as missing)
    assert rows["label"] == [1, 0, 1, 0, 1, 0, None]  # an empty label is still missing (classify.py: one line)
    (tmp_path / "plain.csv").write_text("text,label\nhello,1\nworld,0\n")
    assert str(load_data(tmp_path / "plain.csv").features["text"]) == "Value('large_string')"  # as datasets reads it
    (tmp_path / "pairs.csv").write_text("prompt,chosen,rejected\nQ?,42,NA\nR?,None,\n")  # dpo.py's columns
    pairs = load_data(tmp_path / "pairs.csv")
    assert (pairs["chosen"], pairs["rejected"]) == (["42", "None"], ["NA", ""])
    (tmp_path / "header.csv").write_text("text,label\n")  # datasets: 'Instruction "train" corresponds to no data!'
    with pytest.raises(DataError, match=r"header.csv has no rows$"):
        load_data(tmp_path / "header.csv")
