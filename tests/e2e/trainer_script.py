"""One transformers ``Trainer`` run on a tiny Llama, by transformers' own class or by mtk's (``--trainer``).

The same script is the single-process (or plain ``torchrun``) reference and the mtk run under ``accelerate launch``
at any layout: it writes the Trainer's ``log_history`` (loss, grad_norm, learning_rate, eval_loss per step) to
``<output_dir>/log_history.json`` for the test to compare. Examples have uneven lengths, padding and
prompt tokens without loss, so token weighting over accumulation and replicas matters.
"""

import argparse
import json
import os
from pathlib import Path

import torch
import transformers
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, TrainingArguments

VOCAB = 101  # not a multiple of the TP size: the vocabulary is padded


# what both tiny models share
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
)


def moe_model() -> Qwen3MoeForCausalLM:
    """A tiny Qwen3-MoE (4 experts of width 32, two per token, the load-balancing loss in the loss)."""
    torch.manual_seed(0)
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, router_aux_loss_coef=0.01)
    config = Qwen3MoeConfig(**SHAPE, **experts, num_hidden_layers=2, head_dim=8, output_router_logits=True)
    return Qwen3MoeForCausalLM(config)


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, intermediate_size=64, num_hidden_layers=4, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def examples(count: int, seed: int) -> Dataset:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        length = int(torch.randint(5, 18, (), generator=generator))
        ids = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        prompt = int(torch.randint(1, 4, (), generator=generator))
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return Dataset.from_list(rows)


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded batch: pad id 0, no loss and no attention on padding."""
    width = max(len(row["input_ids"]) for row in rows)
    batch = {"input_ids": [], "labels": [], "attention_mask": []}
    for row in rows:
        pad = width - len(row["input_ids"])
        batch["input_ids"].append(row["input_ids"] + [0] * pad)
        batch["labels"].append(row["labels"] + [-100] * pad)
        batch["attention_mask"].append([1] * len(row["input_ids"]) + [0] * pad)
    return {key: torch.tensor(value) for key, value in batch.items()}


def token_accuracy(prediction) -> dict[str, float]:
    """Next-token accuracy over the evaluation's label tokens, from the full logits (argmax over the vocabulary)."""
    logits, labels = torch.as_tensor(prediction.predictions), torch.as_tensor(prediction.label_ids)
    assert logits.shape[-1] == VOCAB, logits.shape  # never a vocabulary shard
    predicted, target = logits[:, :-1].argmax(-1), labels[:, 1:]
    counted = target != -100
    return {"accuracy": ((predicted == target) & counted).sum().item() / counted.sum().item()}


class TrialHistories(transformers.TrainerCallback):
    """Each trial's ``log_history`` (the Trainer's state is the last trial's only)."""

    def __init__(self) -> None:
        self.histories: list[list[dict]] = []

    def on_train_end(self, args, state, control, **kwargs):
        self.histories.append(list(state.log_history))


def search_trials(trainer_class, training: TrainingArguments, args) -> None:
    """``hyperparameter_search`` over one learning rate (each trial the same run): ``trials.json`` holds every
    trial's history."""
    histories = TrialHistories()
    trainer = trainer_class(
        model_init=lambda trial=None: model(),
        args=training,
        data_collator=collate,
        train_dataset=examples(48, seed=1),
        eval_dataset=examples(12, seed=2),
        callbacks=[histories],
    )
    trainer.hyperparameter_search(
        hp_space=lambda trial: {"learning_rate": trial.suggest_categorical("learning_rate", [1e-2])},
        backend="optuna",
        n_trials=args.search,
        direction="minimize",
    )
    if trainer.is_world_process_zero():
        Path(args.output_dir, "trials.json").write_text(json.dumps(histories.histories))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=["hf", "mtk"], required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--grad_accum", type=int, default=2)
    parser.add_argument("--save_steps", type=int, default=0)
    parser.add_argument("--eval_steps", type=int, default=2, help="0: no evaluation")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--save_model", action="store_true")
    parser.add_argument("--deepspeed", default=None, help="a DeepSpeed JSON (TrainingArguments.deepspeed)")
    parser.add_argument("--metrics", action="store_true", help="evaluate token accuracy from the logits too")
    parser.add_argument("--loss_only", action="store_true", help="TrainingArguments.prediction_loss_only")
    parser.add_argument("--moe", action="store_true", help="a tiny Qwen3-MoE instead of the tiny Llama")
    parser.add_argument("--search", type=int, default=0, help="hyperparameter_search (optuna) of this many trials")
    parser.add_argument("--label_smoothing", type=float, default=0.0, help="TrainingArguments.label_smoothing_factor")
    args = parser.parse_args()
    if args.trainer == "mtk":
        from mtk.trainers import Trainer
    else:
        Trainer = transformers.Trainer
    training = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.max_steps,
        learning_rate=1e-2,
        weight_decay=0.01,
        warmup_steps=1,
        max_grad_norm=1.0,
        logging_steps=1,
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        deepspeed=args.deepspeed,
        prediction_loss_only=args.loss_only,
        label_smoothing_factor=args.label_smoothing,
    )
    if args.search:  # each trial builds its model again (model_init) and sets its engine up again
        search_trials(Trainer, training, args)
        return
    trainer = Trainer(
        model=moe_model() if args.moe else model(),
        args=training,
        data_collator=collate,
        train_dataset=examples(48, seed=1),
        eval_dataset=examples(12, seed=2),
        compute_metrics=token_accuracy if args.metrics else None,
    )
    trainer.train(resume_from_checkpoint=args.resume)
    if args.save_model:
        trainer.save_model(os.path.join(args.output_dir, "final"))
    if trainer.is_world_process_zero():
        Path(args.output_dir, "log_history.json").write_text(json.dumps(trainer.state.log_history))


if __name__ == "__main__":
    from mtk.training.entry import run_main  # (the launched worker's exit, as mtk's examples leave)

    run_main(main, "trainer_script.py")
