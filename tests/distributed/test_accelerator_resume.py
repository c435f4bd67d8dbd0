"""Exact resume with accelerate's default DataLoader settings (no seedable sampler), at DP=2.

accelerate does not checkpoint a shuffled ``RandomSampler``'s generator; ``mtk.Accelerator.load_state``
re-draws the completed epochs' orders (``mtk.integrations.accelerate.shuffle``), so a run stopped in its third
epoch continues with the batches the uninterrupted run saw. The pure function is checked too.
"""

import torch
from torch.utils.data import DataLoader

from mtk.integrations.accelerate.shuffle import replay_shuffles
from mtk.testing import run_distributed

EPOCH_BATCHES, TOTAL = 6, 18  # micro-batches per epoch (per replica), where to end


def _train(rank, world_size, checkpoint, mode, stop_at=0):
    """``stop``: train to ``stop_at`` and save; ``resume``: load and train on to TOTAL; ``full``: TOTAL at once."""
    from mtk import Accelerator

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.arange(24, dtype=torch.float32).unsqueeze(1)  # 12 samples per replica, batches of 2
    loader = DataLoader(data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if mode == "resume":
        accelerator.load_state(checkpoint)
    end = stop_at if mode == "stop" else TOTAL
    seen = []
    while accelerator.micro_batches_seen < end:
        epoch, skip = divmod(accelerator.micro_batches_seen, EPOCH_BATCHES)
        loader.set_epoch(epoch)
        for batch in accelerator.skip_first_batches(loader, skip) if skip else loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
            seen.append(batch.flatten().tolist())
            if accelerator.micro_batches_seen == end:
                break
    if mode == "stop":
        accelerator.save_state(checkpoint)
    return seen, accelerator.unwrap_model(model).weight.item()


def test_resume_with_accelerate_default_sampler_is_exact(tmp_path):
    """Stopped inside the third epoch, and on the last batch of the second (the loop breaks there: accelerate
    counted that pass only once its iterator ran out, and the resumed third epoch drew the second's order again)."""
    full = run_distributed(_train, world_size=2, args=("", "full"))
    for stop_at in (15, 2 * EPOCH_BATCHES):
        checkpoint = str(tmp_path / f"step_{stop_at}")
        stopped = run_distributed(_train, world_size=2, args=(checkpoint, "stop", stop_at))
        resumed = run_distributed(_train, world_size=2, args=(checkpoint, "resume"))
        for rank in range(2):
            assert len(full[rank][0]) == TOTAL
            assert stopped[rank][0] + resumed[rank][0] == full[rank][0], f"rank {rank}: resumed batches differ"
            assert resumed[rank][1] == full[rank][1], f"rank {rank}: weights differ after resume"


def test_replay_shuffles_reaches_the_epoch_start():
    def loader():
        return DataLoader(range(10), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(3))

    first = loader()
    orders = [[b.tolist() for b in first] for _ in range(3)]
    fresh = loader()
    assert replay_shuffles(fresh, 2) == 2
    assert [b.tolist() for b in fresh] == orders[2]
    assert replay_shuffles(DataLoader(range(10), shuffle=False), 2) == 0


def _guarded(rank, world_size, checkpoint, seed):
    """Save (``seed`` None) or resume a run whose script guards its ``--seed`` (a ResumeGuard, as the examples'):
    what the resume refused, if anything."""
    from mtk import Accelerator
    from mtk.checkpoint.resume import ResumeGuard
    from mtk.errors import CheckpointError

    accelerator = Accelerator()
    model = torch.nn.Linear(1, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.register_for_checkpointing(ResumeGuard(seed=0 if seed is None else seed))
    if seed is None:
        accelerator.save_state(checkpoint)
        return ""
    try:
        accelerator.load_state(checkpoint)
    except CheckpointError as err:
        return str(err)
    return ""


def test_a_labelled_checkpoint_without_its_resume_guard_is_refused(tmp_path):
    """The guard's file deleted and left out of the metadata's list: a resume with another --seed trained on, the
    guard skipped as if the checkpoint predated it (the re-check's D-C). Every labelled save holds it."""
    import json

    checkpoint = tmp_path / "step"
    run_distributed(_guarded, world_size=1, args=(str(checkpoint), None))
    assert "changes --seed 0 -> 7" in run_distributed(_guarded, world_size=1, args=(str(checkpoint), 7))[0]
    (checkpoint / "custom_checkpoint_0.pt").unlink()
    meta = json.loads((checkpoint / "metadata.json").read_text())
    meta["files"].pop("custom_checkpoint_0.pt")
    (checkpoint / "metadata.json").write_text(json.dumps(meta))
    said = run_distributed(_guarded, world_size=1, args=(str(checkpoint), 7))[0]
    assert "holds no custom_checkpoint_0.pt" in said, said


def _save_with_generation(rank, world_size, checkpoint):
    """A tiny causal LM whose generation config was changed to one transformers' strict save refuses (a
    temperature without sampling): save_state, then the generation config the checkpoint holds."""
    import json
    from pathlib import Path

    from mtk import Accelerator
    from mtk.models import build_model

    accelerator = Accelerator()
    model = build_model("tiny-llama")
    model.generation_config.temperature = 0.7  # generate() warns; GenerationConfig.save_pretrained raised
    model.generation_config.eos_token_id = [2, 5]
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.save_state(checkpoint)
    saved = json.loads((Path(checkpoint) / "generation_config.json").read_text())
    from mtk.integrations.accelerate.save import save_pretrained  # (the Trainers' save_model, --save_model)

    save_pretrained(accelerator, model, Path(checkpoint).parent / "final")
    assert json.loads((Path(checkpoint).parent / "final" / "generation_config.json").read_text()) == saved
    return saved


def test_a_checkpoint_keeps_the_models_generation_config_as_set(tmp_path):
    """Each checkpoint saves the model's generation_config.json (mtk export copies it), written as the model holds
    it: the first save_state of a model whose config transformers' strict save refuses was a traceback, and
    nothing was saved; the final save_model (sft.py, dpo.py) was the same traceback after the whole run."""
    saved = run_distributed(_save_with_generation, world_size=1, args=(str(tmp_path / "step"),))[0]
    assert saved["temperature"] == 0.7 and saved["eos_token_id"] == [2, 5]


def _hook_installed(rank, world_size):
    import sys

    from mtk import Accelerator

    Accelerator()
    return bool(getattr(sys.excepthook, "_mtk", False))


def test_an_own_loop_reports_mtk_errors_in_one_line():
    """A user's own loop (mtk.Accelerator, not mtk's scripts or trainers): an mtk error that reaches the top was a
    traceback on every rank; the Accelerator installs the scripts' one-line report (other errors keep Python's)."""
    assert run_distributed(_hook_installed, world_size=1) == [True]


def _resume_with_a_longer_schedule(rank, world_size, checkpoint):
    """4 steps of a linear decay to 0 at step 4, saved; resumed with the decay stretched to step 6 (a longer
    --max_steps): the learning rate of step 5 is the new schedule's, as an uninterrupted 6-step run's."""
    from mtk import Accelerator
    from mtk.models import build_model

    def run(steps: int, resume: bool) -> tuple[float, float]:
        accelerator = Accelerator()
        model = build_model("tiny-llama")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / steps))
        model, optimizer, schedule = accelerator.prepare(model, optimizer, schedule)
        if resume:
            accelerator.load_state(checkpoint)
        else:
            for _ in range(4):
                optimizer.step()
                schedule.step()
            accelerator.save_state(checkpoint)
        return optimizer.param_groups[0]["lr"], schedule.get_last_lr()[0]

    saved = run(4, resume=False)
    same = run(4, resume=True)
    longer = run(6, resume=True)
    return [saved, same, longer]


def test_a_resume_with_a_longer_schedule_steps_at_its_rate(tmp_path):
    """The optimizer restored the old schedule's last rate (0), which LambdaLR's load_state_dict left: the first
    resumed step of a longer run moved nothing (transformers' Trainer does the same)."""
    checkpoint = str(tmp_path / "step_4")
    saved, same, longer = run_distributed(_resume_with_a_longer_schedule, world_size=1, args=(checkpoint,))[0]
    assert saved == same == (0.0, 0.0)
    assert longer == (1e-3 * (1 - 4 / 6),) * 2
