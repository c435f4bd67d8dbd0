"""An ordinary TRL script (SFT or DPO) whose only mtk line is its import (``--trainer mtk``).

With ``--trainer trl`` it is the reference: TRL's own trainer on one process, or on plain ``torchrun`` processes
for DP. It reads a local model directory (tiny Llama and a BPE tokenizer with a chat template) and chat data,
and writes the trainer's ``log_history`` to ``<output_dir>/log_history.json`` for the test to compare.
"""

import argparse
import json
import random
from pathlib import Path

from datasets import Dataset


def chats(path: str) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in Path(path).read_text().splitlines()]


def preference_pairs(conversations: list[list[dict]], seed: int = 0) -> Dataset:
    """Prompt = the conversation up to its last assistant turn; chosen = that turn; rejected = another's."""
    rng = random.Random(seed)
    answers = [chat[-1]["content"] for chat in conversations]
    rows = []
    for chat in conversations:
        other = rng.choice([a for a in answers if a != chat[-1]["content"]])
        rows.append(
            {
                "prompt": chat[:-1],
                "chosen": [{"role": "assistant", "content": chat[-1]["content"]}],
                "rejected": [{"role": "assistant", "content": other}],
            }
        )
    return Dataset.from_list(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("task", choices=["sft", "dpo"])
    parser.add_argument("--trainer", choices=["trl", "mtk"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--eval_data", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--lora_alpha", type=float, default=8, help="with --lora")
    parser.add_argument("--dropout", action="store_true", help="DPOConfig(disable_dropout=False)")
    parser.add_argument("--examples", type=int, default=48)
    parser.add_argument("--save_steps", type=int, help="write checkpoint-N every N steps (default: none)")
    parser.add_argument("--resume_from_checkpoint", help="resume from this checkpoint-N directory")
    parser.add_argument("--save_model", help="trainer.save_model() into this directory after training")
    parser.add_argument("--deepspeed", help="a DeepSpeed JSON (TrainingArguments.deepspeed)")
    args = parser.parse_args()
    if args.trainer == "mtk":
        from mtk.trainers import DPOTrainer, SFTTrainer
    else:
        from trl import DPOTrainer, SFTTrainer
    from transformers import AutoTokenizer
    from trl import DPOConfig, SFTConfig

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    common = dict(
        output_dir=args.output_dir,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=args.max_steps,
        learning_rate=1e-3,
        warmup_steps=1,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        bf16=False,  # TRL's default is bf16; the comparison is fp32
        deepspeed=args.deepspeed,
    )
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=args.lora_alpha, target_modules=["q_proj", "v_proj", "up_proj"])
    if args.task == "sft":
        train = Dataset.from_list([{"messages": c} for c in chats(args.data)[: args.examples]])
        evaluation = Dataset.from_list([{"messages": c} for c in chats(args.eval_data)[:12]])
        config = SFTConfig(**common, max_length=96, packing=args.packing)
        trainer = SFTTrainer(
            model=args.model,
            args=config,
            train_dataset=train,
            eval_dataset=evaluation,
            processing_class=tokenizer,
            peft_config=peft_config,
        )
    else:
        train = preference_pairs(chats(args.data)[: args.examples])
        evaluation = preference_pairs(chats(args.eval_data)[:12], seed=1)
        config = DPOConfig(**common, max_length=96, disable_dropout=not args.dropout)
        trainer = DPOTrainer(
            model=args.model,
            args=config,
            train_dataset=train,
            eval_dataset=evaluation,
            processing_class=tokenizer,
            peft_config=peft_config,
        )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if args.save_model:
        trainer.save_model(args.save_model)
    if trainer.is_world_process_zero():
        Path(args.output_dir, "log_history.json").write_text(json.dumps(trainer.state.log_history))
    if args.trainer == "mtk":
        trainer.end()  # transformers' last call of a script: the processes leave together
    # else not: TRL's plain DDP reference would leave DDP's Reducer the last owner of the destroyed world group, and
    # freeing the trainer as main returns can then hang (pytorch#56297; tests/e2e/own_loop_script.py says more)


if __name__ == "__main__":
    from mtk.training.entry import run_main  # (the launched worker's exit, as mtk's examples leave)

    run_main(main, "trl_script.py")
