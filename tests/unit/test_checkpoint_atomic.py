"""A crash during a save never leaves a directory that looks like a checkpoint."""

import json

import pytest
import torch

import mtk.checkpoint.sharded as sharded
from mtk.checkpoint import CheckpointError, CheckpointPaths
from mtk.checkpoint.sharded import load_checkpoint, read_metadata, save_checkpoint
from mtk.convert import parallelize
from mtk.models import build_model
from mtk.parallel import ParallelState


def _setup():
    state = ParallelState.build()
    model = parallelize(build_model("tiny-llama"), state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    optimizer.step()
    return state, model, optimizer


def test_interrupted_save_is_not_a_checkpoint(tmp_path, monkeypatch):
    state, model, optimizer = _setup()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(sharded, "save_optimizer", crash)
    with pytest.raises(CheckpointError, match="cannot write checkpoint .*step_5: disk full; the previous checkpoints"):
        save_checkpoint(tmp_path / "step_5", state, model, [optimizer], [], step=5)
    assert not (tmp_path / "step_5").exists()
    assert (tmp_path / "step_5.incomplete" / "model").is_dir()  # the partial write is visibly incomplete
    with pytest.raises(CheckpointError, match="does not exist"):
        read_metadata(tmp_path / "step_5")
    with pytest.raises(CheckpointError, match="not a complete mtk checkpoint"):
        read_metadata(tmp_path / "step_5.incomplete")


def test_round_trip_and_overwrite(tmp_path):
    state, model, optimizer = _setup()
    save_checkpoint(tmp_path / "step_1", state, model, [optimizer], [], step=1)
    save_checkpoint(tmp_path / "step_1", state, model, [optimizer], [], step=1)  # replaces it whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
    fresh_state, fresh, fresh_opt = _setup()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    meta = load_checkpoint(tmp_path / "step_1", fresh_state, fresh, [fresh_opt], [])
    assert meta.step == 1 and json.loads((tmp_path / "step_1" / "metadata.json").read_text())["format"]
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
    fresh_params = dict(fresh.named_parameters())
    for name, param in model.named_parameters():
        a, b = optimizer.state[param], fresh_opt.state[fresh_params[name]]
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]), name


def test_missing_shard_of_another_layout_is_named(tmp_path):
    state, model, optimizer = _setup()
    save_checkpoint(tmp_path / "c", state, model, [optimizer], [], step=1)
    meta_path = tmp_path / "c" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["topology"].update(tp=2, world=2)
    meta_path.write_text(json.dumps(meta))
    # the file list verifies, but the layout writes a tp01 shard it does not list: named before anything is read
    with pytest.raises(CheckpointError, match=r"lists no model/tp01-pp00.safetensors, which its layout \(tp 2, pp 1"):
        load_checkpoint(tmp_path / "c", state, model, [optimizer], [])


@pytest.mark.parametrize(
    "content, message",
    [
        ("{", "is not valid mtk checkpoint metadata"),
        ("[1, 2]", "is not valid mtk checkpoint metadata"),
        ('{"format": "mtk-checkpoint/1", "step": 1}', "is not valid mtk checkpoint metadata"),
        ('{"format": "other/9"}', "has format 'other/9'"),
    ],
)
def test_damaged_metadata_is_one_clear_error(tmp_path, content, message):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "metadata.json").write_text(content)
    with pytest.raises(CheckpointError, match=message):
        read_metadata(tmp_path / "c")


def test_paths_name_every_file_once():
    paths = CheckpointPaths("ckpt")
    assert paths.weights(1, 0).as_posix() == "ckpt/model/tp01-pp00.safetensors"
    assert paths.optimizer(0, 2, 1).as_posix() == "ckpt/optimizer/tp00-pp02-1"
    assert (paths.scheduler(0).name, paths.scheduler(2).name, paths.rng(3).name) == (
        "scheduler.pt",
        "scheduler_2.pt",
        "rank00003.pt",
    )
