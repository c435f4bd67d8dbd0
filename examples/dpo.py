"""Preference tuning with TRL's ``DPOTrainer`` at any TP x DP layout: an ordinary TRL script that imports mtk's
trainer instead of TRL's (and sets up inside ``library_refusals``: a setting TRL refuses is one line).

    accelerate launch --config_file accelerate_configs/tp2.yaml examples/dpo.py
    accelerate launch --config_file accelerate_configs/tp2.yaml examples/dpo.py \\
        --model_name_or_path runs/sft --data data/python_docs_pairs.jsonl

Every ``DPOConfig`` field is a flag (``--beta``, ``--loss_type``, ...; docs/trainers.md says what each does under
mtk). ``--data`` holds JSON lines with ``prompt``, ``chosen`` and ``rejected`` (text or chat messages). Defaults: a
tiny Llama with random weights and a tokenizer trained on the data (nothing to download), on pairs made from
examples/data/instructions.jsonl: each instruction's completion is chosen, another instruction's is rejected. The
reference model is a frozen copy converted to the same layout, as TRL keeps one.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C while the libraries below load (seconds): stop quietly, not their traceback
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)  # (run_main says it in one line from then on)

import copy
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from datasets import Dataset
from trl import DPOConfig, TrlParser

from mtk.checkpoint.resume import check_output_place
from mtk.data.sources import load_data
from mtk.data.tokenizers import directory_tokenizer
from mtk.errors import library_refusals
from mtk.trainers import DPOTrainer
from mtk.trainers.arguments import check_deepspeed_file, epochs_over_a_default_step_count, refuse_null_settings
from mtk.training.entry import run_main

HERE = Path(__file__).resolve().parent


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(default="", metadata={"help": "a local HF model directory; default: a tiny Llama"})
    data: str = field(default="", metadata={"help": "JSON lines with prompt, chosen, rejected; default: made up"})
    eval_data: str = field(default="", metadata={"help": "pairs to evaluate on (with --eval_strategy steps)"})


def made_up_pairs(instructions: Path, seed: int = 0) -> Dataset:
    """Each instruction's own completion chosen over another instruction's."""
    rows = [json.loads(line) for line in instructions.read_text().splitlines()]
    rng = random.Random(seed)
    pairs = []
    for row in rows:
        other = rng.choice([r["completion"] for r in rows if r["completion"] != row["completion"]])
        pairs.append({"prompt": row["prompt"], "chosen": row["completion"], "rejected": other})
    return Dataset.from_list(pairs)


def main() -> None:
    with library_refusals():  # a setting transformers or TRL refuse: one line, not their traceback
        parser = TrlParser((ScriptArguments, DPOConfig))
        parser.set_defaults(output_dir="runs/dpo", max_steps=20, logging_steps=5, learning_rate=1e-4, report_to="none")
        parser.set_defaults(bf16=torch.cuda.is_available(), dataloader_pin_memory=torch.cuda.is_available())
        parser.set_defaults(per_device_train_batch_size=8, max_length=256)
        refuse_null_settings(parser)  # (a null the arguments' checks would compare with a number)
        check_deepspeed_file()  # (a file that is not JSON: named, before transformers reads it)
        script, config = parser.parse_args_and_config()
        epochs_over_a_default_step_count(parser, config)  # (--num_train_epochs alone: the epochs, not max_steps=20)
        if script.data:
            check_output_place(config.output_dir, script.data)  # (not among the data files)
            dataset = load_data(script.data, "--data")
        else:
            dataset = made_up_pairs(HERE / "data" / "instructions.jsonl")
        reference = None  # TRL loads it from the model's directory
        if script.model_name_or_path:
            model, tokenizer = script.model_name_or_path, directory_tokenizer(script.model_name_or_path)
        else:
            from sft import starter_model  # the same tiny model and tokenizer as examples/sft.py

            # (rows without these columns are DPOTrainer's one line)
            texts = [row[key] for row in dataset for key in ("prompt", "chosen") if isinstance(row.get(key), str)]
            model, tokenizer = starter_model(texts)
            reference = copy.deepcopy(model)  # a model built in memory has no directory to load a reference from
        evaluation = load_data(script.eval_data, "--eval_data") if script.eval_data else None
        trainer = DPOTrainer(
            model=model,
            ref_model=reference,
            args=config,
            train_dataset=dataset,
            eval_dataset=evaluation,
            processing_class=tokenizer,
        )
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    trainer.save_model()
    trainer.end()  # trackers finished, the processes leave together


if __name__ == "__main__":
    run_main(main, "dpo.py")
