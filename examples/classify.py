"""Sentence classification with a BERT encoder: the plain Accelerate loop, tensor-parallel.

    accelerate launch --config_file accelerate_configs/tp2.yaml examples/classify.py
    accelerate launch --config_file accelerate_configs/tp2.yaml examples/classify.py --resume ckpts/classify/step_150

Compared with a plain accelerate script only the ``Accelerator`` import changed (and the model is
built from a config here because there is no hub): prepare, accumulate, backward, log, save_state
every 50 steps, resume, gather_for_metrics, unwrap + save_pretrained all work as they did.
Default: ``tiny-bert`` on the bundled examples/data/sentiment.csv.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader

from mtk import Accelerator
from mtk.args import ArgumentParser, add_safety_arguments, collective_timeout, positive_float, positive_int
from mtk.checkpoint.resume import add_resume_arguments, start_point
from mtk.data import ByteTokenizer
from mtk.errors import run_main
from mtk.models import build_model
from mtk.parallel.grad_norm import check_finite
from mtk.signals import ExitSignal

HERE = Path(__file__).resolve().parent


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-bert", help="built-in BERT config name")
    parser.add_argument("--data", default=str(HERE / "data" / "sentiment.csv"), help="csv with text,label columns")
    parser.add_argument("--max_steps", type=positive_int, default=200)
    parser.add_argument("--save_every", type=positive_int, default=50)
    parser.add_argument("--output_dir", default="ckpts/classify")
    add_resume_arguments(parser, example="ckpts/classify/step_150")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=positive_float, default=1e-3)
    parser.add_argument("--batch_size", type=positive_int, default=16)
    parser.add_argument("--grad_accum", type=positive_int, default=1)
    parser.add_argument("--max_length", type=positive_int, default=64)
    parser.add_argument("--max_grad_norm", type=positive_float, default=1.0)
    add_safety_arguments(parser)
    return parser.parse_args(argv)


def encode(batch, tokenizer: ByteTokenizer, max_length: int) -> dict:
    ids = [tokenizer.encode(text)[:max_length] for text in batch["text"]]
    return {
        "input_ids": [row + [tokenizer.pad_token_id] * (max_length - len(row)) for row in ids],
        "attention_mask": [[1] * len(row) + [0] * (max_length - len(row)) for row in ids],
        "labels": batch["label"],
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.grad_accum,
        log_with="tensorboard",
        project_dir=args.output_dir,
        # shuffle order as a function of (seed, epoch): resume is exact whatever else used the RNGs
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=collective_timeout(args))],
    )
    set_seed(args.seed)
    tokenizer = ByteTokenizer()
    raw = load_dataset("csv", data_files=args.data, split="train").train_test_split(test_size=0.2, seed=args.seed)
    encoded = raw.map(
        encode,
        batched=True,
        remove_columns=raw["train"].column_names,
        fn_kwargs=dict(tokenizer=tokenizer, max_length=args.max_length),
    ).with_format("torch")
    train, test = encoded["train"], encoded["test"]
    model = build_model(args.model, seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # The loader draws its seeds from its own generator, so starting an epoch never moves the global RNG
    # (dropout): a resumed run, which starts its epoch after restoring the RNG, draws the same masks.
    loader_rng = torch.Generator().manual_seed(args.seed)
    train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True, generator=loader_rng)
    eval_loader = DataLoader(test, batch_size=args.batch_size)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    accelerator.init_trackers("runs")

    resume = start_point(args, main_process=accelerator.is_main_process, barrier=accelerator.wait_for_everyone)
    step = 0
    if resume:
        accelerator.load_state(resume)
        step = accelerator.completed_steps
    if step >= args.max_steps:
        accelerator.print(f"mtk: {resume} is at step {step}, --max_steps is {args.max_steps}: nothing left to do")
        accelerator.end_training()
        return
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
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
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
            if step % args.save_every == 0 or stopped:
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
