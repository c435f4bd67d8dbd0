"""A user's own accelerate loop, unchanged but for the import: ``--mtk`` takes ``mtk.Accelerator`` (the layout from
``accelerate launch --config_file``), otherwise accelerate's on one process is the reference.

Its batches are what a user's collator makes: padded to their longest row (odd lengths, not a multiple of the TP
size), rows of uneven length, and the loop passes no ``num_items_in_batch``: the model's own token-mean loss. Prints
the per-step losses and the final gradient norm as JSON on the main process.
"""

import argparse
import json

import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from mtk.models import build_model

STEPS, BATCH = 4, 4


def rows() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(5, 24, (STEPS * BATCH,), generator=generator)
    return [torch.randint(0, 256, (int(n),), generator=generator) for n in lengths]


def collate(batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    longest = max(len(row) for row in batch)
    if longest % 2 == 0:  # an odd length, as a user's data has about half the time
        longest += 1
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(batch):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mtk", action="store_true")
    parser.add_argument("--dummies", action="store_true", help="the DeepSpeed JSON's optimizer and scheduler")
    args = parser.parse_args()
    if args.mtk:
        from mtk import Accelerator
    else:
        from accelerate import Accelerator
    accelerator = Accelerator()
    set_seed(0)
    model = build_model("tiny-llama", seed=0)
    loader = DataLoader(rows(), batch_size=BATCH, collate_fn=collate)
    if args.dummies:  # accelerate's DeepSpeed example: the JSON's optimizer and scheduler, over STEPS steps
        from accelerate.utils import DummyOptim, DummyScheduler

        optimizer = DummyOptim(model.parameters(), lr=1e-3)
        scheduler = DummyScheduler(optimizer, total_num_steps=STEPS, warmup_num_steps=1)
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, rates, norm = [], [], None
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if args.dummies:
            scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        rates.append(optimizer.param_groups[0]["lr"])
    if accelerator.is_main_process:
        print(json.dumps({"losses": losses, "grad_norm": float(norm), "rates": rates}))
    if args.mtk:
        accelerator.end_training()
    # else not: plain accelerate's end_training destroys the world group and leaves DDP's Reducer its last owner;
    # freeing the model as main returns then hangs about one run in seven (torch joins the group's gloo threads
    # holding the GIL, pytorch#56297). mtk keeps its groups owned (mtk/parallel/state.py).


if __name__ == "__main__":
    from mtk.training.entry import run_main

    run_main(main, "own_loop_script.py")
