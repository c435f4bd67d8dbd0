"""Supervised fine-tuning with TRL's ``SFTTrainer`` at any TP x PP x DP layout: an ordinary TRL script that imports
mtk's trainer instead of TRL's (and sets up inside ``library_refusals``: a setting TRL refuses is one line).

    accelerate launch --config_file accelerate_configs/tp2_pp2.yaml examples/sft.py
    accelerate launch --config_file accelerate_configs/tp2.yaml examples/sft.py \\
        --model_name_or_path models/smollm2-135m-instruct --data data/python_docs_chat.jsonl

Every ``SFTConfig`` field is a flag (``--learning_rate``, ``--packing``, ``--save_steps``, ...; docs/trainers.md
says what each does under mtk). Defaults: a tiny Llama with random weights and a chat tokenizer trained on the data
in a second (nothing to download), on examples/data/instructions.jsonl (``prompt``/``completion`` rows: the loss
is on the completions); fp32 on a machine without a GPU. ``--data`` takes TRL's formats (``messages``, ``text``,
``prompt`` + ``completion``) as JSON lines (or CSV, Parquet, a folder of them, a ``save_to_disk`` dataset). The
layout comes from the accelerate config; with a DeepSpeed one, pass
``--deepspeed ds_configs/accelerate_zero2_tp2.json`` (TP from its ``"mtk"`` block).
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C while the libraries below load (seconds): stop quietly, not their traceback
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)  # (run_main says it in one line from then on)

from dataclasses import dataclass, field
from pathlib import Path

import torch
from trl import SFTConfig, TrlParser

from mtk.checkpoint.resume import check_output_place
from mtk.data.sources import load_data
from mtk.data.tokenizers import directory_tokenizer
from mtk.errors import library_refusals
from mtk.trainers import SFTTrainer
from mtk.trainers.arguments import check_deepspeed_file, epochs_over_a_default_step_count, refuse_null_settings
from mtk.training.entry import run_main

HERE = Path(__file__).resolve().parent


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(default="", metadata={"help": "a local HF model directory; default: a tiny Llama"})
    data: str = field(
        default=str(HERE / "data" / "instructions.jsonl"),
        metadata={"help": "JSON lines (CSV, Parquet), TRL's formats"},
    )
    eval_data: str = field(default="", metadata={"help": "JSON lines to evaluate on (with --eval_strategy steps)"})


def starter_model(texts: list[str]):
    """The built-in tiny Llama and a BPE chat tokenizer trained on ``texts`` (the same on every rank)."""
    from mtk.models import build_model, builtin_config
    from mtk.testing import train_chat_tokenizer

    tokenizer = train_chat_tokenizer(texts)
    config = builtin_config("tiny-llama")
    config.update({"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None})
    config.update({"pad_token_id": tokenizer.pad_token_id})
    return build_model(config, seed=0), tokenizer


def texts_of(row: dict) -> list[str]:
    if "messages" in row:  # (a tool call's content is null; a malformed row is SFTTrainer's one line)
        turns = row["messages"] if isinstance(row["messages"], list) else []
        return [turn["content"] for turn in turns if isinstance(turn, dict) and isinstance(turn.get("content"), str)]
    return [value for key, value in row.items() if key in ("text", "prompt", "completion") and isinstance(value, str)]


def main() -> None:
    with library_refusals():  # a setting transformers or TRL refuse: one line, not their traceback
        parser = TrlParser((ScriptArguments, SFTConfig))
        parser.set_defaults(output_dir="runs/sft", max_steps=40, logging_steps=5, learning_rate=1e-3, report_to="none")
        parser.set_defaults(bf16=torch.cuda.is_available(), dataloader_pin_memory=torch.cuda.is_available())
        parser.set_defaults(per_device_train_batch_size=8, max_length=256)
        refuse_null_settings(parser)  # (a null the arguments' checks would compare with a number)
        check_deepspeed_file()  # (a file that is not JSON: named, before transformers reads it)
        script, config = parser.parse_args_and_config()
        epochs_over_a_default_step_count(parser, config)  # (--num_train_epochs alone: the epochs, not max_steps=40)
        check_output_place(config.output_dir, script.data)  # (not among the data files)
        train = load_data(script.data, "--data")
        evaluation = load_data(script.eval_data, "--eval_data") if script.eval_data else None
        if script.model_name_or_path:  # (each file read alone: TRL takes an eval file in another of its formats)
            model, tokenizer = script.model_name_or_path, directory_tokenizer(script.model_name_or_path)
        else:
            model, tokenizer = starter_model([text for row in train for text in texts_of(row)])
        trainer = SFTTrainer(
            model=model, args=config, train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer
        )
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    trainer.save_model()
    trainer.end()  # trackers finished, the processes leave together


if __name__ == "__main__":
    run_main(main, "sft.py")
