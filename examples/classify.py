"""Sentence classification with a BERT encoder: the plain Accelerate loop, tensor-parallel.

    accelerate launch --config_file accelerate_configs/tp2.yaml examples/classify.py
    accelerate launch --config_file accelerate_configs/tp2.yaml examples/classify.py --resume ckpts/classify/step_150

Compared with a plain accelerate script only the ``Accelerator`` import changed: prepare, accumulate,
backward, log, save_state every 50 steps, resume, gather_for_metrics, unwrap + save_pretrained all
work as they did. Default: ``tiny-bert`` (random weights, byte tokenizer) on the bundled
examples/data/sentiment.csv. ``--model`` also takes a local HF directory with its tokenizer (e.g. a
real BERT such as all-MiniLM-L6-v2; its classification head starts fresh). ``--data`` and
``--eval_data`` are local files in any format mtk reads, with ``text`` and ``label`` columns (labels
as names or as ids 0..K-1); without ``--eval_data`` a fifth of ``--data`` is held out.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C while the libraries below load (seconds): stop quietly, not their traceback
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)  # (run_main says it in one line from then on)

import argparse
import functools
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed
from datasets import Dataset
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification

from mtk import Accelerator
from mtk.args import (
    ArgumentParser,
    add_safety_arguments,
    collective_timeout,
    directory,
    non_negative_int,
    positive_float,
    positive_int,
    seed,
)
from mtk.checkpoint.resume import ResumeGuard, add_resume_arguments, start_point
from mtk.config import RunSettings
from mtk.data import ByteTokenizer, add_tokenizer_argument, load_data, pad_id_of, tokenizer_for
from mtk.errors import ConfigError, DataError
from mtk.integrations.accelerate.save import check_no_shards_to_clean
from mtk.models import auto_class_for, build_model, resolve_config
from mtk.parallel.grad_norm import check_finite
from mtk.rules import check_tp_size
from mtk.training.entry import run_main
from mtk.training.signals import ExitSignal

HERE = Path(__file__).resolve().parent


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-bert", help="built-in BERT config name or local HF directory")
    add_tokenizer_argument(parser)
    parser.add_argument(
        "--data", default=str(HERE / "data" / "sentiment.csv"), help="local rows with text and label columns"
    )
    parser.add_argument("--eval_data", help="evaluation rows (default: a fifth of --data, held out)")
    parser.add_argument("--max_steps", type=positive_int, default=200)
    parser.add_argument(
        "--save_every", type=non_negative_int, default=50, help="save_state every N steps (0: only at the end)"
    )
    parser.add_argument("--output_dir", type=directory, default="ckpts/classify")
    add_resume_arguments(parser, example="ckpts/classify/step_150")
    parser.add_argument("--seed", type=seed, default=0)
    parser.add_argument("--lr", type=positive_float, default=1e-3)
    parser.add_argument("--batch_size", type=positive_int, default=16)
    parser.add_argument("--grad_accum", type=positive_int, default=1)
    parser.add_argument("--max_length", type=positive_int, default=64)
    parser.add_argument(
        "--max_grad_norm",
        type=positive_float,
        help="default: megatron_lm_gradient_clipping, else a DeepSpeed config's gradient_clipping, else 1.0",
    )
    add_safety_arguments(parser)
    return parser.parse_args(argv)


def check_rows(rows: Dataset, name: str) -> None:
    """Every row of a file as read (row numbers are the file's, before any split) has a text and a label."""
    missing = {"text", "label"} - set(rows.column_names)
    if missing:
        raise DataError(f"{name} has columns {rows.column_names}; classification needs 'text' and 'label'")
    labels = rows["label"]
    for row, label in enumerate(labels):  # 0-based, as mtk.data names rows; first the missing ones: a CSV
        # column with an empty cell reads as floats, and row 0's 1.0 would be named instead of the empty row
        if label is None or (isinstance(label, str) and not label.strip()) or label != label:  # NaN
            raise DataError(f"{name} row {row} has no label; every row needs one")
    for row, label in enumerate(labels):
        if isinstance(label, float) or isinstance(label, bool) or not isinstance(label, (int, str)):
            raise DataError(f"{name} row {row} has label {label!r}; labels are names or integer ids 0..K-1")


def label_ids(train: Dataset, evaluation: Dataset, held_out: str = "--eval_data") -> dict[Any, int]:
    """Label (a name or an id) -> id: names in sorted order, ids as they are (0..K-1). ``held_out``: what the
    evaluation rows are called (the file's option, or the part of --data held out)."""
    unseen = sorted(set(evaluation["label"]) - set(train["label"]), key=str)
    if unseen:  # a class the head would hold but training never shows it
        raise DataError(
            f"{held_out} has label {unseen[0]!r}, which no training row has; every evaluation label must be one the "
            "training data has"
        )
    values = set(train["label"]) | set(evaluation["label"])
    spelled: dict[str, Any] = {}
    for value in sorted(values, key=str):  # "pos", "Pos" and "pos " would train as three classes
        key = str(value).strip().casefold()
        if key in spelled:
            raise DataError(
                f"the labels {spelled[key]!r} and {value!r} differ only in case or spaces; spell each label one way"
            )
        spelled[key] = value
    numbers = sorted(str(v) for v in values if str(v).strip().lstrip("-").isdigit())
    names = sorted(str(v) for v in values if not str(v).strip().lstrip("-").isdigit())
    if numbers and names:  # "1" and "pos" would train as two classes
        raise DataError(
            f"the labels mix integer ids and names ({numbers[0]!r} and {names[0]!r}); give every label as a name or "
            "every label as an id 0..K-1"
        )
    if len(values) < 2:
        raise DataError(
            f"the data has one label ({next(iter(values))!r}): nothing to classify (a one-label head would train as "
            "a regression); give rows of at least two labels"
        )
    if all(isinstance(v, int) for v in values):
        if min(values) < 0:
            raise DataError(f"label ids must be 0..K-1, got {min(values)}; or give the labels as names")
        check_id_range(values)
        return {v: v for v in range(max(values) + 1)}
    return {v: i for i, v in enumerate(sorted(values, key=str))}


def check_id_range(ids: set[int]) -> None:
    """Refuse integer label ids that would make the head far wider than the labels seen: an id is a class index, so
    ids 0 and 100000000 built a head of 10^8 classes (and its mapping), which the kernel killed without a message.
    A few gaps ({0, 2}: three classes, one never trained) stay allowed."""
    classes, bound = max(ids) + 1, 4 * len(ids) + 16
    if classes > bound:
        raise DataError(
            f"label id {max(ids)} would make a head of {classes} classes for the {len(ids)} labels the data has "
            f"(label ids are class indices; at most {bound} classes, 4 x labels + 16); renumber the labels 0..K-1, "
            "or give them as names"
        )


def encode(batch, tokenizer: Any, max_length: int, ids: dict[Any, int]) -> dict:
    if isinstance(tokenizer, ByteTokenizer):
        tokens = {"input_ids": [tokenizer.encode(text)[:max_length] for text in batch["text"]]}
    else:
        tokens = tokenizer(batch["text"], truncation=True, max_length=max_length)
    return {**tokens, "labels": [ids[label] for label in batch["label"]]}


def pad(features: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Pad a batch to its longest sentence (right side); attention mask 0 on the padding."""
    longest = max(len(f["input_ids"]) for f in features)
    batch = {"labels": torch.tensor([f["labels"] for f in features])}
    for key, fill in (("input_ids", pad_id), ("token_type_ids", 0)):
        if key in features[0]:
            batch[key] = torch.tensor([list(f[key]) + [fill] * (longest - len(f[key])) for f in features])
    batch["attention_mask"] = torch.tensor(
        [[1] * len(f["input_ids"]) + [0] * (longest - len(f["input_ids"])) for f in features]
    )
    return batch


def main(argv=None) -> None:
    args = parse_args(argv)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.grad_accum,
        log_with="tensorboard",
        project_dir=args.output_dir,
        # shuffle order as a function of (seed, epoch): resume is exact whatever else used the RNGs
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=collective_timeout(args))],
        run_settings=RunSettings.from_env(gradient_clipping=args.max_grad_norm),  # (DeepSpeed clips by it too)
    )
    set_seed(args.seed)
    tokenizer = tokenizer_for(args.model, args.tokenizer, resolve_config(args.model).vocab_size)
    raw = load_data(args.data)
    check_rows(raw, "--data")
    held_out = "--eval_data"
    if args.eval_data:
        train_rows, eval_rows = raw, load_data(args.eval_data, held_out)
        check_rows(eval_rows, held_out)
    else:
        split = raw.train_test_split(test_size=0.2, seed=args.seed)
        train_rows, eval_rows = split["train"], split["test"]
        held_out = "the fifth of --data held out for evaluation (no --eval_data)"
    ids = label_ids(train_rows, eval_rows, held_out)
    options = dict(tokenizer=tokenizer, max_length=args.max_length, ids=ids)
    train = train_rows.map(encode, batched=True, remove_columns=train_rows.column_names, fn_kwargs=options)
    test = eval_rows.map(encode, batched=True, remove_columns=eval_rows.column_names, fn_kwargs=options)
    accelerator.print(f"mtk: {len(train)} training and {len(test)} evaluation sentences, {len(ids)} labels")
    config = resolve_config(args.model)
    check_tp_size(config, accelerator.parallel.tp_size)
    names = {i: str(label) for label, i in ids.items()}
    if Path(args.model).is_dir():  # a real encoder; the classification head starts fresh (same on every rank)
        model = AutoModelForSequenceClassification.from_pretrained(
            args.model,
            num_labels=len(ids),
            id2label=names,
            label2id={v: k for k, v in names.items()},
            use_safetensors=True,  # weights from safetensors only (a pickle can run code when loaded)
        )
        accelerator.checkpoint_tokenizer = tokenizer  # checkpoints (and `mtk export`) carry it
    else:
        if auto_class_for(config) is not AutoModelForSequenceClassification:  # (a built-in causal LM: tiny-llama)
            raise ConfigError(
                f"--model {args.model} is a built-in {config.model_type} causal LM, which classify.py does not train: "
                "give tiny-bert, or a local HF directory of a model with a sequence-classification head"
            )
        config.num_labels, config.id2label = len(ids), names
        config.label2id = {v: k for k, v in names.items()}
        model = build_model(config, seed=args.seed)
    collate = functools.partial(pad, pad_id=pad_id_of(tokenizer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # The loader draws its seeds from its own generator, so starting an epoch never moves the global RNG
    # (dropout): a resumed run, which starts its epoch after restoring the RNG, draws the same masks.
    loader_rng = torch.Generator().manual_seed(args.seed)
    train_loader = DataLoader(
        train, batch_size=args.batch_size, shuffle=True, drop_last=True, generator=loader_rng, collate_fn=collate
    )
    eval_loader = DataLoader(test, batch_size=args.batch_size, collate_fn=collate)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    if len(train_loader) == 0:  # (the partial batch is dropped: no step, and the epoch arithmetic divided by 0)
        replicas = accelerator.parallel.dp_size
        raise DataError(
            f"--data has {len(train)} training rows, fewer than one batch of --batch_size {args.batch_size}"
            + (f" on each of {replicas} data-parallel replicas" if replicas > 1 else "")
            + "; use a smaller --batch_size or more rows"
        )
    accelerator.init_trackers("runs")

    resume = start_point(args, main_process=accelerator.is_main_process, barrier=accelerator.wait_for_everyone)
    check_no_shards_to_clean(f"{args.output_dir}/model")  # before training: the last save_pretrained would delete them
    # a resumed run must continue the same data stream: a changed --data, --max_length, --seed, ... is one line
    accelerator.register_for_checkpointing(ResumeGuard.from_args(args))
    step = 0
    if resume:
        accelerator.load_state(resume)
        step = accelerator.completed_steps
    if step >= args.max_steps:
        accelerator.print(f"mtk: {resume} is at step {step}, --max_steps is {args.max_steps}: nothing left to do")
        accelerator.end_training()
        return
    max_grad_norm = accelerator.settings.gradient_clipping or 1.0
    exit_signal = ExitSignal(accelerator.device)  # SIGTERM/SIGINT: save at the next step boundary and exit
    stopped = False
    model.train()
    while step < args.max_steps and not stopped:
        epoch, skip = divmod(accelerator.micro_batches_seen, len(train_loader))
        train_loader.set_epoch(epoch)
        for batch in accelerator.skip_first_batches(train_loader, skip) if skip else train_loader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                accelerator.backward(outputs.loss)
                finite = True
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                    finite = check_finite(grad_norm, step + 1, skip=args.skip_nonfinite)  # global norm: all agree
                if finite:
                    optimizer.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            loss = accelerator.reduce(outputs.loss.detach(), "mean").item()
            accelerator.log({"train/loss": loss}, step=step)
            if step % 10 == 0:
                accelerator.print(f"step {step} loss {loss!r}")
            stopped = exit_signal.requested()  # agreed over all ranks
            due = step % args.save_every == 0 if args.save_every else step >= args.max_steps
            if due or stopped:
                accelerator.save_state(f"{args.output_dir}/step_{step}")
            if stopped:
                accelerator.print(
                    f"mtk: {exit_signal.name}: saved {args.output_dir}/step_{step}; continue with --resume auto"
                )
                accelerator.end_training()
                return
            if step >= args.max_steps:
                break

    model.eval()
    correct = total = 0
    for batch in eval_loader:
        with torch.no_grad():
            predictions = model(**batch).logits.argmax(dim=-1)
        predictions, labels = accelerator.gather_for_metrics((predictions, batch["labels"]))
        correct += (predictions == labels).sum().item()
        total += labels.numel()
    accelerator.print(f"eval accuracy {correct / total:.3f} on {total} sentences")
    accelerator.log({"eval/accuracy": correct / total}, step=step)

    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(
        f"{args.output_dir}/model",
        is_main_process=accelerator.is_main_process,
        state_dict=accelerator.get_state_dict(model),
        save_function=accelerator.save,
    )
    accelerator.end_training()


if __name__ == "__main__":
    run_main(main, "classify.py")
