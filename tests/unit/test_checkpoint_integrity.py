"""Checkpoints prove their integrity: checksums in the metadata, checked by resume, export and
``mtk verify-checkpoint``; mtk never removes a directory it did not create."""

import copy
import errno
import json
import os
import pickle
import re
import stat
import struct

import pytest
import torch
from safetensors import SafetensorError

from mtk.checkpoint import CheckpointError
from mtk.checkpoint.atomic import MARKER
from mtk.checkpoint.export import export_checkpoint
from mtk.checkpoint.integrity import file_checksum
from mtk.checkpoint.resume import ResumeGuard, remove_checkpoints
from mtk.checkpoint.sharded import load_checkpoint, save_checkpoint
from mtk.cli.main import main as mtk_main
from mtk.convert import parallelize
from mtk.data import ByteTokenizer
from mtk.data.sources import data_fingerprint
from mtk.integrations.accelerate.save import check_no_shards_to_clean, check_target, save_pretrained
from mtk.models import build_model
from mtk.parallel import ParallelState

SHARD = "model/tp00-pp00.safetensors"


@pytest.fixture(scope="module")
def trained():
    parallel = ParallelState.build()
    model = parallelize(build_model("tiny-llama"), parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.tensor([[1, 2, 3, 4]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return parallel, model, optimizer


@pytest.fixture
def saved(tmp_path, trained):
    parallel, model, optimizer = trained
    return save_checkpoint(tmp_path / "step_2", parallel, model, [optimizer], [], step=2)


def _load(directory, trained):
    parallel, model, optimizer = trained
    return load_checkpoint(directory, parallel, model, [optimizer], [])


def _flip_byte(path, offset=-10):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _verify_cli(directory, capsys) -> tuple[int, str, str]:
    code = mtk_main(["verify-checkpoint", str(directory)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_metadata_records_every_file_and_the_run(saved, trained, capsys):
    meta = json.loads((saved / "metadata.json").read_text())
    assert meta["format"] == "mtk-checkpoint/2" and len(meta["run_id"]) == 32
    files = sorted(p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file())
    assert sorted(meta["files"]) == [f for f in files if f != "metadata.json"]
    assert all(len(r["xxh3_128"]) == 32 and r["bytes"] > 0 for r in meta["files"].values())
    assert not list(saved.rglob(MARKER)), "the in-progress marker is not published"
    assert _load(saved, trained).step == 2
    code, out, _ = _verify_cli(saved, capsys)
    assert code == 0 and f"ok, {len(meta['files'])} files" in out


def _replace_with_fifo(path):
    """A named pipe where a file was: reading it would block, so it is named, never opened."""
    path.unlink()
    os.mkfifo(path)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: _flip_byte(d / SHARD), f"{SHARD} does not match its recorded xxh3_128"),
        (lambda d: (d / SHARD).write_bytes((d / SHARD).read_bytes()[:-1]), f"{SHARD} has"),
        (lambda d: (d / "rng" / "rank00000.pt").unlink(), "rng/rank00000.pt is missing"),
        (lambda d: (d / "model" / "tp01-pp00.safetensors").write_bytes(b"x"), "is not part of the checkpoint"),
        (lambda d: _replace_with_fifo(d / "rng" / "rank00000.pt"), "rng/rank00000.pt is not a regular file"),
    ],
    ids=["flipped-byte", "truncated", "missing", "foreign-file", "fifo"],
)
def test_damage_is_named_by_resume_export_and_verify(saved, trained, tmp_path, capsys, damage, message):
    damage(saved)
    with pytest.raises(CheckpointError, match=message.replace(".", r"\.")):
        _load(saved, trained)
    with pytest.raises(CheckpointError, match="cannot be trusted"):
        export_checkpoint(saved, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob("hf*")), "nothing written"
    code, _, err = _verify_cli(saved, capsys)
    assert code == 2 and err.count("\n") == 1 and message in err and "Traceback" not in err


def test_a_shard_from_another_step_is_refused(tmp_path, trained):
    parallel, model, optimizer = trained
    first = save_checkpoint(tmp_path / "step_1", parallel, model, [optimizer], [], step=1)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    second = save_checkpoint(tmp_path / "step_2", parallel, model, [optimizer], [], step=2)
    (second / SHARD).write_bytes((first / SHARD).read_bytes())
    with pytest.raises(CheckpointError, match="replaced by another run's or step's file"):
        _load(second, trained)


@pytest.mark.parametrize(
    "name",
    [SHARD, "optimizer/tp00-pp00.safetensors", "optimizer/tp00-pp00.json", "rng/rank00000.pt", "scheduler.pt"],
)
def test_a_file_from_another_save_is_refused_even_with_its_checksum_recorded(tmp_path, trained, capsys, name):
    """Each file carries its save's label: a file copied in from another save of the same run, its checksum rewritten
    into the metadata, verified and trained on where it counted nothing the metadata records (a pipeline stage's
    weights, an FSDP2 piece's moments: the seventh campaign's re-check)."""
    parallel, model, optimizer = trained
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    first = save_checkpoint(tmp_path / "step_1", parallel, model, [optimizer], [scheduler], step=2)
    second = save_checkpoint(tmp_path / "step_2", parallel, model, [optimizer], [scheduler], step=2)
    (second / name).write_bytes((first / name).read_bytes())
    _rewrite_metadata(second, lambda meta: meta["files"].update({name: _record(second / name)}))
    label = json.loads((second / "metadata.json").read_text())["save"]
    for said in _refusals(second, trained, tmp_path, capsys):
        assert f"{name} was written by the save labelled" in said and f"not by this checkpoint's ('{label}')" in said
    _rewrite_metadata(second, lambda meta: meta.pop("save"))  # a label removed from the metadata: still refused
    assert all(
        "this checkpoint's metadata records no label" in said for said in _refusals(second, trained, tmp_path, capsys)
    )


def test_metadata_rewritten_to_the_first_format_does_not_turn_the_checks_off(saved, trained, tmp_path, capsys):
    """``format`` set to the first (no checksums) and ``files`` emptied: every check was off, and a pipeline stage's
    weights from another save trained with exit 0 (the re-check's N2). The first format recorded no run id, label or
    counts, and no file of its saves carries a label."""
    _rewrite_metadata(saved, lambda meta: meta.update(format="mtk-checkpoint/1", files={}))
    for said in _refusals(saved, trained, tmp_path, capsys):
        assert "says format mtk-checkpoint/1 but records 'run_id', which only later formats write" in said, said
    _rewrite_metadata(saved, lambda meta: [meta.pop(k) for k in ("run_id", "save", "counts")])
    for said in _refusals(saved, trained, tmp_path, capsys):
        assert "was written by the save labelled" in said and "holds no labelled file" in said, said


@pytest.mark.parametrize("positions", [[], [0, 0]], ids=["none-recorded", "one-more"])
def test_recorded_scheduler_positions_cover_the_scheduler_files(tmp_path, trained, capsys, positions):
    """``scheduler_positions: []`` switched the position check off (a scheduler from another save then trained on);
    two positions for one scheduler file were refused by verify but resumed."""
    parallel, model, optimizer = trained
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    directory = save_checkpoint(tmp_path / "step_2", parallel, model, [optimizer], [scheduler], step=2)
    _rewrite_metadata(directory, lambda meta: meta["counts"].update(scheduler_positions=positions))
    for said in _refusals(directory, trained, tmp_path, capsys):
        assert f"records the positions of {len(positions)} schedulers, the checkpoint holds 1 scheduler" in said


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda meta: meta["counts"].pop("scheduler_positions"), "records no counts.scheduler_positions"),
        (lambda meta: meta["counts"].pop("optimizer_steps"), "records no counts.optimizer_steps"),
        (lambda meta: meta["counts"].pop("fewest_optimizer_steps"), "records no counts.fewest_optimizer_steps"),
        (lambda meta: meta["counts"].pop("learning_rates"), "records no counts.learning_rates"),
        (lambda meta: meta.pop("counts"), "records no counts.scheduler_positions"),
        (lambda meta: meta.pop("data"), "records no data.micro_batches"),
        (lambda meta: meta["data"].update(micro_batches=None), "records no data.micro_batches"),
        (lambda meta: meta["data"].update(micro_batches=4, samples=None), "records no data.samples"),
        (
            lambda meta: meta["data"].update(micro_batches=4, samples=None, samples_per_micro_batch=None),
            "records 4 micro-batches consumed but not their size",
        ),  # fmt: skip
    ],
    ids=["positions", "steps", "fewest", "rates", "counts", "data", "data-null", "samples-null", "size-null"],
)
def test_a_labelled_save_without_its_records_is_refused(tmp_path, trained, capsys, change, said):
    """A record removed from a labelled save's metadata switched the check it feeds off, as an emptied list did
    (the re-check's D-C: every ::step 1000 with counts removed, data replayed from 0 with data removed, the scheduler
    at 100 with its position removed trained with exit 0); every save since labels writes them all."""
    parallel, model, optimizer = trained
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    position = {"micro_batches": 2, "samples_per_micro_batch": 4, "samples": 8}
    directory = save_checkpoint(tmp_path / "step_2", parallel, model, [optimizer], [scheduler], step=2, data=position)
    _rewrite_metadata(directory, change)
    for refusal in _refusals(directory, trained, tmp_path, capsys):
        assert said in refusal, refusal


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda meta: meta["counts"].update(learning_rates=[]), "records the learning rates of 0 optimizers"),
        (lambda meta: meta["counts"].update(scheduler_positions=[None]), "at position 0 where the metadata recorded"),
        (lambda meta: meta["data"].update(micro_batches=4, samples_per_micro_batch=0, samples=0), "of 0 samples"),
        (lambda meta: meta.update(engine="deepspeed", zero_stage="2"), "zero_stage '2' is not a ZeRO stage"),
        (lambda meta: meta["counts"].update(learning_rates=[[0.001], [0.001]]), "learning rates of 2 optimizers"),
    ],
    ids=["rates-emptied", "position-null", "size-0", "stage-str", "rates-of-two"],
)
def test_a_record_emptied_or_nulled_checks_as_removed(tmp_path, trained, capsys, change, said):
    """The re-check after the ninth round: an emptied list of learning rates checked no optimizer (lr 5 in the JSON:
    step 4 loss 176.2), a null position no scheduler (one at 100 trained on), micro-batches of 0 samples no data
    position; each is one line from resume (and verify, where it reads that record)."""
    from mtk.checkpoint.resume import rescaled_position

    parallel, model, optimizer = trained
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    position = {"micro_batches": 2, "samples_per_micro_batch": 4, "samples": 8}
    directory = save_checkpoint(tmp_path / "step_2", parallel, model, [optimizer], [scheduler], step=2, data=position)
    _rewrite_metadata(directory, change)
    with pytest.raises(CheckpointError, match=re.escape(said)):
        meta = load_checkpoint(directory, parallel, model, [optimizer], [scheduler])
        rescaled_position(meta.data, 4)  # what the Accelerator's load_state reads next
    if "samples" not in said:
        code, _, err_text = _verify_cli(directory, capsys)
        assert code == 2 and len(err_text.strip().splitlines()) == 1, err_text


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("accelerate_step", "x", "data.accelerate_step 'x' is not a count of steps"),
        ("accelerate_step", -1, "data.accelerate_step -1 is not a count of steps"),
        ("dataloader_iterations", None, "data.dataloader_iterations None is not a list of counts"),
        ("dataloader_iterations", [1.5], "data.dataloader_iterations [1.5] is not a list of counts"),
    ],
)
def test_data_position_fields_of_another_type_are_one_line(saved, trained, tmp_path, capsys, field, value, said):
    """``accelerate_step`` and ``dataloader_iterations`` were read unchecked: a string or a null was a TypeError
    traceback on every rank of a resume."""
    _rewrite_metadata(saved, lambda meta: meta["data"].update({field: value}))
    for refusal in _refusals(saved, trained, tmp_path, capsys):
        assert said in refusal, refusal


@pytest.mark.parametrize("name", ["rng/rank00000.pt", "optimizer/tp00-pp00.json", "optimizer/tp00-pp00.safetensors"])
def test_a_file_deleted_and_left_out_of_the_list_is_one_line_on_resume(saved, trained, name):
    """A file a reader needs, deleted and removed from ``files`` (so no checksum misses it), was a FileNotFoundError
    traceback deep in the reader."""
    (saved / name).unlink()
    _rewrite_metadata(saved, lambda meta: meta["files"].pop(name))
    with pytest.raises(CheckpointError, match=r"is missing"):
        _load(saved, trained)


def test_a_checkpoint_written_before_labels_is_read_as_before(tmp_path, trained, monkeypatch):
    parallel, model, optimizer = trained
    monkeypatch.setattr("mtk.checkpoint.sharded.new_label", lambda step: None)
    directory = save_checkpoint(tmp_path / "step_2", parallel, model, [optimizer], [], step=2)
    assert "mtk_save" not in (directory / SHARD).read_bytes()[:4096].decode(errors="replace")
    assert _load(directory, trained).save is None


def test_save_never_removes_what_mtk_did_not_create(tmp_path, trained):
    parallel, model, optimizer = trained
    theirs = tmp_path / "step_3.incomplete"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="was not created by mtk; move it away"):
        save_checkpoint(tmp_path / "step_3", parallel, model, [optimizer], [], step=3)
    assert (theirs / "notes.txt").read_text() == "mine"
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "table.csv").write_text("1,2")
    with pytest.raises(CheckpointError, match="is not an mtk checkpoint; mtk will not replace it"):
        save_checkpoint(folder, parallel, model, [optimizer], [], step=3)
    assert (folder / "table.csv").read_text() == "1,2"


def test_a_users_file_inside_a_checkpoint_stops_its_replacement_and_overwrite(tmp_path, trained):
    """A rewind that saves step_N again, and --overwrite, would take the user's notes put into a checkpoint with it:
    a file the metadata does not list stops both, in one line, and nothing is removed."""
    from mtk.checkpoint.resume import remove_checkpoints

    parallel, model, optimizer = trained
    saved = save_checkpoint(tmp_path / "step_2", parallel, model, [optimizer], [], step=2)
    (saved / "model" / "NOTES.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"step_2 holds model/NOTES.txt, which its checkpoint does not list"):
        save_checkpoint(tmp_path / "step_2", parallel, model, [optimizer], [], step=2)
    with pytest.raises(CheckpointError, match=r"mtk removes only files it wrote: move them out of it"):
        remove_checkpoints(tmp_path)
    assert (saved / "model" / "NOTES.txt").read_text() == "mine" and (saved / "metadata.json").is_file()
    (saved / "model" / "NOTES.txt").unlink()
    save_checkpoint(tmp_path / "step_2", parallel, model, [optimizer], [], step=2)  # its own files only: replaced
    assert remove_checkpoints(tmp_path) == ["step_2"]


def test_a_step_folder_with_another_tools_metadata_is_never_removed(tmp_path):
    """A metadata.json is mtk's when it names an mtk checkpoint format: an evaluation harness's step_3/ holding its
    own metadata.json was removed by --overwrite with every file in it."""
    from mtk.checkpoint.atomic import check_replaceable
    from mtk.checkpoint.resume import complete_checkpoints, remove_checkpoints

    theirs = tmp_path / "step_3"
    theirs.mkdir()
    (theirs / "metadata.json").write_text('{"tool": "my-eval-harness", "step": 3}')
    (theirs / "results.csv").write_text("accuracy,0.91")
    assert complete_checkpoints(tmp_path) == [] and remove_checkpoints(tmp_path) == []  # (no checkpoint of mtk's)
    with pytest.raises(CheckpointError, match=r"step_3 exists and is not an mtk checkpoint \(its metadata.json is an"):
        check_replaceable(theirs)  # (a save there, and a start with it ahead of the run: one line)
    # damaged: still listed (reading it says what is wrong), but nothing removes what cannot be told to be mtk's
    (theirs / "metadata.json").write_bytes(b'{"format": "mtk-checkpoint/2", "\xff')
    assert [folder for _, folder in complete_checkpoints(tmp_path)] == [theirs]
    with pytest.raises(CheckpointError, match=r"step_3/metadata.json cannot be read as mtk checkpoint metadata \(dam"):
        remove_checkpoints(tmp_path)
    assert (theirs / "results.csv").read_text() == "accuracy,0.91"
    (theirs / "metadata.json").unlink()
    os.mkfifo(theirs / "metadata.json")  # (read, it blocked the main process and every rank with it)
    assert complete_checkpoints(tmp_path) == []
    with pytest.raises(CheckpointError, match="step_3 exists and is not an mtk checkpoint"):
        check_replaceable(theirs)


def test_a_leftover_of_an_interrupted_save_is_cleaned_at_the_next_save(tmp_path, trained):
    parallel, model, optimizer = trained
    for name in ("step_4.incomplete", "step_9.incomplete", "step_2.old"):  # this save's, a later one's (crash,
        leftover = tmp_path / name  # then resume from an earlier step), a replaced one's
        leftover.mkdir()
        (leftover / MARKER).touch()
        (leftover / "half.safetensors").write_bytes(b"partial")
    (tmp_path / "hf.abc.incomplete").mkdir()  # no marker: not mtk's save (an export in progress), kept
    save_checkpoint(tmp_path / "step_4", parallel, model, [optimizer], [], step=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf.abc.incomplete", "step_4"]


def test_export_leaves_other_files_alone(saved, tmp_path):
    theirs = tmp_path / "hf.incomplete"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("mine")
    export_checkpoint(saved, tmp_path / "hf", progress=False)
    assert (theirs / "keep.txt").read_text() == "mine"
    assert (tmp_path / "hf" / "config.json").is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file; export into a new directory"):
        export_checkpoint(saved, tmp_path / "file", progress=False)


def _rewrite_metadata(directory, change):
    meta = json.loads((directory / "metadata.json").read_text())
    change(meta)
    (directory / "metadata.json").write_text(json.dumps(meta))


def _refusals(directory, trained, tmp_path, capsys) -> list[str]:
    """What resume, export and verify-checkpoint each say of ``directory`` (each must refuse it)."""
    said = []
    for read in (lambda: _load(directory, trained), lambda: export_checkpoint(directory, tmp_path / "out")):
        with pytest.raises(CheckpointError) as err:
            read()
        said.append(str(err.value))
    code, _, err_text = _verify_cli(directory, capsys)
    assert code == 2 and "\n" not in err_text.strip()
    return said + [err_text]


@pytest.mark.parametrize(
    "entry",
    ["../outside.bin", "/etc/hostname", "model/../../outside.bin", "model/" + "a" * 300],
    ids=["parent", "absolute", "parent-inside-a-path", "longer-than-a-file-name-may-be"],
)
def test_metadata_cannot_name_a_file_outside_the_checkpoint(saved, trained, tmp_path, capsys, entry):
    """A listed path that leaves the checkpoint is refused by name, never read, hashed or measured: the
    message says nothing of the outside file (its size), whatever it is. A name the file system cannot hold (its
    lookup fails with ENAMETOOLONG) is no file of the checkpoint either."""
    (saved.parent / "outside.bin").write_bytes(b"x" * 1234)
    _rewrite_metadata(saved, lambda meta: meta["files"].update({entry: {"bytes": 1, "xxh3_128": "0" * 32}}))
    for message in _refusals(saved, trained, tmp_path, capsys):
        assert "not a file inside the checkpoint" in message and "1234" not in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("entry", ["model/./tp00-pp00.safetensors", "model//tp00-pp00.safetensors", "a\nok\x1b[2K"])
def test_metadata_names_each_file_once_and_plainly(saved, trained, tmp_path, capsys, entry):
    """A second spelling of a listed file (it verified twice, "11 files" of 10) or a name with control characters
    (a newline forged an "ok" line in the message) is refused as damaged metadata, the name shown escaped."""
    _rewrite_metadata(saved, lambda meta: meta["files"].update({entry: {"bytes": 1, "xxh3_128": "0" * 32}}))
    for message in _refusals(saved, trained, tmp_path, capsys):
        assert "not a plain relative path" in message and "\x1b" not in message
    assert not (tmp_path / "out").exists()


def test_a_link_inside_a_checkpoint_is_refused_not_followed(saved, trained, tmp_path, capsys):
    """A tokenizer/ that links to another folder (whose files are then listed, checksums and all) is refused:
    verify-checkpoint does not call it ok and export copies nothing from the link's target."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret.txt").write_text("not the checkpoint's")
    (saved / "tokenizer").symlink_to(elsewhere, target_is_directory=True)
    record = {"bytes": 20, "xxh3_128": file_checksum(elsewhere / "secret.txt")}
    _rewrite_metadata(saved, lambda meta: meta["files"].update({"tokenizer/secret.txt": record}))
    for message in _refusals(saved, trained, tmp_path, capsys):
        assert "tokenizer" in message and ("symbolic link" in message or "not a file inside" in message)
    assert not (tmp_path / "out").exists()


class _Payload:
    def __reduce__(self):  # what a crafted pickle carries: weights_only refuses to call it
        return (os.system, ("echo ran",))


_FOREIGN = "does not hold what this run loads from it"


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("rng/rank00000.pt", lambda: pickle.dumps(_Payload()), _FOREIGN),
        ("optimizer/tp00-pp00.json", lambda: b'{"param_groups": "x"}', "carries no save label"),
        ("optimizer/tp00-pp00.json", lambda: b"{not json", _FOREIGN),
    ],
    ids=["pickle-payload", "json-of-another-shape", "json-broken"],
)
def test_a_crafted_file_whose_checksum_matches_is_one_line_on_resume(saved, trained, name, content, message):
    """Checksums can be rewritten with the file: content mtk did not write, listed with its true checksum, is refused
    by resume in one line naming the file (weights_only never runs the pickle), not by a reader's traceback."""
    (saved / name).write_bytes(content())
    _rewrite_metadata(saved, lambda meta: meta["files"].update({name: _record(saved / name)}))
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)} {message}"):
        _load(saved, trained)


def _record(path):
    return {"bytes": path.stat().st_size, "xxh3_128": file_checksum(path)}


def test_a_link_in_a_checkpoint_of_the_first_format_is_refused_too(saved, trained, tmp_path, capsys):
    """A format-1 checkpoint (no checksums) is read unverified, but rewriting a checkpoint's metadata to format 1
    must not make a link inside it acceptable: verify-checkpoint said nothing of it and exited 0."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (saved / "tokenizer").symlink_to(elsewhere, target_is_directory=True)
    first = ("files", "run_id", "save", "counts")  # what the first format did not record
    _rewrite_metadata(saved, lambda meta: ([meta.pop(k) for k in first], meta.update(format="mtk-checkpoint/1")))
    code, _, err = _verify_cli(saved, capsys)
    assert code == 2 and "tokenizer is a symbolic link" in err and "\n" not in err.strip()
    with pytest.raises(CheckpointError, match="tokenizer is a symbolic link"):
        _load(saved, trained)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"vocab_size": 10**12}, r"holds model.embed_tokens.weight of shape \(\d+, 64\), its recorded config"),
        ({"num_hidden_layers": 1}, "holds model.layers.1.*which its recorded LlamaForCausalLM config has no place"),
        ({"model_type": "no-such-model"}, "recorded model config cannot be built"),
        (
            {"num_hidden_layers": 3},
            "holds no model.layers.2.*and 8 more, which its recorded LlamaForCausalLM config needs",
        ),
    ],
    ids=["vocab", "layers", "model-type", "more-layers"],
)
def test_an_export_whose_config_and_weights_disagree_is_one_line_before_writing(
    saved, tmp_path, capsys, config, message
):
    """The recorded config and the weights are separate records: a pair that disagrees was written and then
    refused by transformers' reload (a traceback; with --no_verify a directory that does not load). verify-checkpoint
    refuses what export refuses (it called such a checkpoint ok)."""
    _rewrite_metadata(saved, lambda meta: meta["model"]["config"].update(config))
    for verify in (True, False):
        with pytest.raises(CheckpointError, match=message):
            export_checkpoint(saved, tmp_path / "out", progress=False, verify=verify)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.*"))
    code, _, said = _verify_cli(saved, capsys)
    assert code == 2 and re.search(message, said), said


def test_an_export_whose_recorded_class_cannot_take_its_config_is_one_line(saved, tmp_path, capsys):
    """The class is a third record: Qwen2's class on a Llama config raised transformers' AttributeError."""
    _rewrite_metadata(saved, lambda meta: meta["model"].update({"class": "Qwen2ForCausalLM"}))
    message = "recorded model class Qwen2ForCausalLM cannot be built from its recorded config"
    with pytest.raises(CheckpointError, match=message):
        export_checkpoint(saved, tmp_path / "out", progress=False)
    code, _, said = _verify_cli(saved, capsys)
    assert code == 2 and message in said, said


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("vocab_size", "256", 'recorded model config: vocab_size is "256"; it must be a positive whole number'),
        ("tie_word_embeddings", "yes", r'cannot be built \(tie_word_embeddings is "yes": TypeError: .*expected bool'),
        ("id2label", [1], r"cannot be built \(id2label is \[1\]: AttributeError"),
        ("model_type", [1], r"cannot be built \(model_type is \[1\], which transformers .* does not ship"),
    ],
    ids=["size-as-a-string", "strict-field", "mapping-as-a-list", "model-type-as-a-list"],
)
def test_a_recorded_config_field_of_the_wrong_type_is_one_line(saved, tmp_path, capsys, field, value, message):
    """The metadata is data from disk: a recorded config field of the wrong type ended export and verify-checkpoint
    in huggingface_hub's StrictDataclassFieldValidationError (not a ValueError) or an AttributeError, a traceback.
    The values are checked as written, as a --model config's are, and what transformers still refuses is one line
    naming the checkpoint and the field."""
    _rewrite_metadata(saved, lambda meta: meta["model"]["config"].update({field: value}))
    with pytest.raises(CheckpointError, match=message) as err:
        export_checkpoint(saved, tmp_path / "out", progress=False)
    assert str(saved) in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.*"))
    code, _, said = _verify_cli(saved, capsys)
    assert code == 2 and re.search(message, said) and len(said.strip().splitlines()) == 1, said
    assert mtk_main(["export", str(saved), str(tmp_path / "out")]) == 2
    said = capsys.readouterr().err
    assert re.search(message, said) and len(said.strip().splitlines()) == 1, said


@pytest.mark.parametrize("record", [None, 5], ids=["missing", "a-number"])
def test_a_recorded_model_class_that_is_not_a_name_is_one_line(saved, tmp_path, capsys, record):
    """The class beside the config is a record of the metadata too: removed, it was a KeyError traceback."""
    _rewrite_metadata(
        saved, lambda meta: meta["model"].pop("class") if record is None else meta["model"].update({"class": record})
    )
    message = "metadata records the model class as .*, not a transformers class name"
    with pytest.raises(CheckpointError, match=message):
        export_checkpoint(saved, tmp_path / "out", progress=False)
    code, _, said = _verify_cli(saved, capsys)
    assert code == 2 and re.search(message, said) and len(said.strip().splitlines()) == 1, said


def test_verify_checkpoint_refuses_a_step_folder_whose_metadata_records_another_step(saved, capsys):
    """Resume refuses a ``step_N`` recording another step (``--resume auto`` would take it for the newest);
    verify-checkpoint called it ok. A step edited in the metadata disagrees with the save's label (a resume from it
    trained one step and logged it as the next)."""
    import shutil

    renamed = saved.parent / "step_5"
    shutil.copytree(saved, renamed)
    code, _, said = _verify_cli(renamed, capsys)
    assert code == 2 and "records step 2, not 5: a copy or a renamed checkpoint" in said, said
    _rewrite_metadata(saved, lambda meta: meta.update(step=3))
    code, _, said = _verify_cli(saved, capsys)
    assert code == 2 and "records step 3, but the save is labelled 'step_2-" in said, said


def test_a_deepspeed_checkpoint_resumed_without_deepspeed_is_one_line_naming_the_engine(saved, trained):
    """finetune.py without DeepSpeed on run.py's checkpoint said only that an optimizer file was missing."""
    _rewrite_metadata(saved, lambda meta: meta.update(engine="deepspeed", zero_stage=2))
    with pytest.raises(CheckpointError, match="was written by the deepspeed engine .*resume it under deepspeed"):
        _load(saved, trained)


def test_deepspeed_state_from_another_save_is_refused(tmp_path, trained):
    """DeepSpeed restores its own state (and its own scheduler) at the layout that wrote it: a ``deepspeed/`` folder
    from another save of the run, whose checksums were rewritten, trained on from another step without a word. Its
    step count and its scheduler's position must be the ones the metadata recorded."""
    from types import SimpleNamespace

    from mtk.checkpoint.counts import engine_state_sums
    from mtk.integrations.deepspeed import load_deepspeed_checkpoint

    parallel, model, optimizer = trained
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    engine_record = {"engine": "deepspeed", "zero_stage": 2}
    partition = torch.nn.Parameter(torch.linspace(-1, 1, 6))  # a rank's flat fp32 partition, stepped once
    inner = torch.optim.AdamW([partition])
    partition.grad = torch.ones(6)
    inner.step()
    directory = save_checkpoint(tmp_path / "step_2", parallel, model, [], [scheduler], step=2, engine=engine_record,
                                engine_state=engine_state_sums(inner, list(model.parameters())),
                                engine_optimizers=[inner])  # fmt: skip

    def engine(steps, position, restored_optimizer=inner, module=model, stage=2, load=None, clip=None):
        """What DeepSpeed's load_checkpoint restored."""
        restored = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        restored.last_epoch = position
        load = load or (lambda *args, **kwargs: (str(directory / "deepspeed"), {}))
        return SimpleNamespace(module=module, global_steps=steps, lr_scheduler=restored, load_checkpoint=load,
                               optimizer=SimpleNamespace(optimizer=restored_optimizer, clip_grad=clip),
                               zero_optimization_stage=lambda: stage, gradient_clipping=lambda: 1.0)  # fmt: skip

    assert load_deepspeed_checkpoint(directory, engine(2, 0), parallel).step == 2
    other = torch.optim.AdamW([torch.nn.Parameter(partition.detach() + 0.5)])  # weights of another save (N1)
    other.load_state_dict(inner.state_dict())
    with pytest.raises(CheckpointError, match="the engine's state restored from its own files is not the one"):
        load_deepspeed_checkpoint(directory, engine(2, 0, other), parallel)
    shifted = copy.deepcopy(model)  # ZeRO-2's module weights (its model_states) of another save or TP rank (D2)
    with torch.no_grad():
        next(shifted.parameters()).add_(1.0)
    with pytest.raises(CheckpointError, match="the engine's state restored from its own files is not the one"):
        load_deepspeed_checkpoint(directory, engine(2, 0, module=shifted), parallel)
    recorded = json.loads((directory / "metadata.json").read_text())["counts"]["engine_state"]
    for cut in ([], recorded * 2, None):  # the record removed or cut in a labelled save: the check is not off (D1)
        _rewrite_metadata(directory, lambda meta, cut=cut: meta["counts"].update(engine_state=cut))
        if cut is None:
            _rewrite_metadata(directory, lambda meta: meta["counts"].pop("engine_state"))
        with pytest.raises(CheckpointError, match="records the engine's state sums of (0|2|no) ranks, its save had 1"):
            load_deepspeed_checkpoint(directory, engine(2, 0), parallel)
    _rewrite_metadata(directory, lambda meta: meta["counts"].update(engine_state=recorded))
    with pytest.raises(CheckpointError, match="DeepSpeed's state counts 3 steps where the metadata says 2"):
        load_deepspeed_checkpoint(directory, engine(3, 0), parallel)
    with pytest.raises(CheckpointError, match="scheduler 0 is at position 7 where the metadata recorded 0"):
        load_deepspeed_checkpoint(directory, engine(2, 7), parallel)
    # DeepSpeed's own numbers that are not tensors (the re-check's D-A): its steps and learning rates are recorded
    for field, value, said in (("step", 1000, "counts 1000 steps where its metadata recorded 1"),
                               ("lr", 5.0, "rates [5.0] are not the [0.001] its metadata recorded")):  # fmt: skip
        edited = torch.optim.AdamW([partition])
        edited.load_state_dict(inner.state_dict())
        if field == "step":
            edited.state[partition]["step"] = torch.tensor(1000.0)
        else:
            edited.param_groups[0]["lr"] = value
        with pytest.raises(CheckpointError, match=re.escape(said)):
            load_deepspeed_checkpoint(directory, engine(2, 0, edited), parallel)
    clipped = engine(2, 0, clip=1e-4)  # the clipping DeepSpeed's state restored yields to this run's, said
    load_deepspeed_checkpoint(directory, clipped, parallel)
    assert clipped.optimizer.clip_grad == 1.0

    def unreadable(*args, **kwargs):
        raise RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory")

    with pytest.raises(CheckpointError, match="DeepSpeed cannot read its state .RuntimeError: PytorchStreamReader"):
        load_deepspeed_checkpoint(directory, engine(2, 0, load=unreadable), parallel)
    with pytest.raises(CheckpointError, match="with ZeRO stage 2, this run is .* with stage 3"):
        load_deepspeed_checkpoint(directory, engine(2, 0, stage=3), parallel)
    _rewrite_metadata(directory, lambda meta: meta["counts"].pop("optimizer_steps"))
    with pytest.raises(CheckpointError, match="records no counts.optimizer_steps, which every save since save labels"):
        load_deepspeed_checkpoint(directory, engine(2, 0), parallel)


def test_verify_checkpoint_checks_the_counts_each_file_keeps(tmp_path, trained, capsys):
    """verify-checkpoint said ok of an optimizer file, a scheduler file or a data position from another save whose
    checksums were rewritten (resume refuses each: tests above); it reads the counts and compares them too."""
    parallel, model, optimizer = trained
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    directory = save_checkpoint(tmp_path / "step_2", parallel, model, [optimizer], [scheduler], step=2)
    _rewrite_metadata(
        directory, lambda meta: meta["data"].update(micro_batches=2, samples_per_micro_batch=8, samples=16)
    )
    assert _verify_cli(directory, capsys)[0] == 0
    originals = {name: (directory / name).read_bytes() for name in ("scheduler.pt", "optimizer/tp00-pp00.safetensors")}

    def edit_scheduler(path):
        torch.save({**torch.load(path, weights_only=True), "last_epoch": 5}, path)

    def edit_steps(path):
        _rewrite_moments(_steps_set_to(1000.0))(directory)

    for name, edit, message in [
        ("scheduler.pt", edit_scheduler, "scheduler.pt is at position 5 where the metadata recorded 0"),
        ("optimizer/tp00-pp00.safetensors", edit_steps, "the optimizer state counts 1000 steps where its metadata"),
    ]:
        edit(directory / name)
        _rewrite_metadata(directory, lambda meta, name=name: meta["files"].update({name: _record(directory / name)}))
        code, _, said = _verify_cli(directory, capsys)
        assert code == 2 and message in said, said
        (directory / name).write_bytes(originals[name])
        _rewrite_metadata(directory, lambda meta, name=name: meta["files"].update({name: _record(directory / name)}))
    _rewrite_metadata(directory, lambda meta: meta["data"].update(samples_per_micro_batch=4))
    code, _, said = _verify_cli(directory, capsys)
    assert code == 2 and "data position disagrees with itself" in said, said
    _rewrite_metadata(directory, lambda meta: meta["data"].update(samples_per_micro_batch=8))
    _rewrite_metadata(directory, lambda meta: meta["counts"].update(scheduler_positions=[0, 0]))
    code, _, said = _verify_cli(directory, capsys)  # (a FileNotFoundError traceback)
    assert code == 2 and "records the positions of 2 schedulers, the checkpoint holds 1 scheduler" in said, said


@pytest.mark.parametrize("base", [{}, "x", {"name_or_path": "b", "peft_type": "LORA", "fingerprint": {"sum": "1"}}])
def test_metadata_naming_a_base_model_of_another_shape_is_refused(saved, trained, tmp_path, capsys, base):
    """``base_model`` {} or "x" ended resume in a KeyError or TypeError traceback, and export sent the user from
    --adapter to a plain export and back."""
    _rewrite_metadata(saved, lambda meta: meta.update(base_model=base))
    for message in _refusals(saved, trained, tmp_path, capsys):
        assert "is not valid mtk checkpoint metadata (base_model " in message, message


def test_metadata_that_lists_no_files_is_refused(saved, trained, tmp_path, capsys):
    _rewrite_metadata(saved, lambda meta: meta.update(files={}))
    for message in _refusals(saved, trained, tmp_path, capsys):
        assert "lists no files" in message


def test_metadata_with_more_pieces_than_files_is_refused(saved, trained, tmp_path, capsys):
    """A crafted ``pieces`` count would make a reader open that many files (or allocate that many entries)."""
    _rewrite_metadata(saved, lambda meta: meta.update(pieces=10**12))
    for message in _refusals(saved, trained, tmp_path, capsys):
        assert "more than the" in message and "files the checkpoint lists" in message


def test_export_copies_no_code_and_no_auto_map(tmp_path, trained):
    """A checkpoint whose tokenizer carries a .py file, a compiled one, a script, a config.json and an auto_map (and
    whose model config names one) exports without any of them: a loader of the export never runs code mtk did not
    write, and only what a tokenizer saves comes along; every file is as open() makes one (the weights were 0600)."""
    parallel, model, optimizer = trained
    directory = tmp_path / "step_1"
    model.config.auto_map = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    try:

        def write_tokenizer(root):  # what a tokenizer with custom code saves
            (root / "tokenizer").mkdir()
            auto_map = {"auto_map": {"AutoTokenizer": ["evil.T", None]}}
            (root / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(auto_map))
            (root / "tokenizer" / "evil.py").write_text("raise SystemExit('ran')\n")
            (root / "tokenizer" / "evil.pyc").write_bytes(b"\x00compiled")
            (root / "tokenizer" / "run.sh").write_text("rm -rf ~\n")
            (root / "tokenizer" / "config.json").write_text(json.dumps({"model_type": "evil"}))  # over the export's

        save_checkpoint(directory, parallel, model, [optimizer], [], step=1, writers=[write_tokenizer])
    finally:
        del model.config.auto_map
    out = export_checkpoint(directory, tmp_path / "out")
    assert not list(out.glob("*.py")) and not (out / "evil.pyc").exists() and not (out / "run.sh").exists()
    assert json.loads((out / "config.json").read_text())["model_type"] != "evil"
    assert "auto_map" not in json.loads((out / "config.json").read_text())
    assert "auto_map" not in json.loads((out / "tokenizer_config.json").read_text())
    mask = os.umask(0)
    os.umask(mask)
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o666 & ~mask}  # as open() makes files


def test_a_linked_step_is_never_written_through(saved, trained, tmp_path):
    """A step_N that is a link to a checkpoint elsewhere: saving over it and --overwrite refuse in one line,
    and nothing (no partial marker, no removal) happens inside the link's target."""
    parallel, model, optimizer = trained
    runs = tmp_path / "ckpts"
    runs.mkdir()
    (runs / "step_2").symlink_to(saved, target_is_directory=True)
    before = sorted(p.name for p in saved.rglob("*"))
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        save_checkpoint(runs / "step_2", parallel, model, [optimizer], [], step=2)
    with pytest.raises(CheckpointError, match="is a symbolic link; --overwrite removes only"):
        remove_checkpoints(runs)
    assert sorted(p.name for p in saved.rglob("*")) == before and (runs / "step_2").is_symlink()
    assert not (runs / "step_2.incomplete").exists()


def test_what_a_run_would_refuse_to_save_over_is_refused_before_it_trains(saved, tmp_path):
    """A link named as a later step, a side directory mtk did not create, a step_N that is not a checkpoint: the save
    refused them once reached (a fresh run's compute was lost); the start refuses them. Steps up to the resumed one,
    mtk's own leftovers and checkpoints are left as they are."""
    from mtk.checkpoint.atomic import MARKER
    from mtk.checkpoint.resume import check_steps_to_write

    runs = tmp_path / "ckpts"
    runs.mkdir()
    (runs / "step_2").symlink_to(saved, target_is_directory=True)
    with pytest.raises(CheckpointError, match="step_2 is a symbolic link; a save of this run would write there"):
        check_steps_to_write(runs, 0)
    check_steps_to_write(runs, 2)  # resumed from it: read, not written
    (runs / "step_3.incomplete").mkdir()
    with pytest.raises(CheckpointError, match="step_3.incomplete exists and was not created by mtk"):
        check_steps_to_write(runs, 2)
    (runs / "step_3.incomplete" / MARKER).write_text("")  # a killed save's leftover: mtk replaces its own
    (runs / "step_4").mkdir()
    (runs / "step_4" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="step_4 exists and is not an mtk checkpoint"):
        check_steps_to_write(runs, 2)
    (runs / "step_4" / "notes.txt").unlink()
    check_steps_to_write(runs, 2)
    (runs / "runs").write_text("mine")  # where tensorboard logs: its FileExistsError came after the start
    with pytest.raises(CheckpointError, match="runs is a file; the run logs into the folder runs/ of --output_dir"):
        check_steps_to_write(runs, 2)


def test_an_output_dir_inside_a_checkpoint_or_the_data_folder_is_refused_before_anything_is_written(saved, tmp_path):
    """A run into a checkpoint's folder wrote its lock, logs and a step there (that checkpoint then failed
    verification and resume); one into its --data folder wrote runs/ there and then blamed the user for it. Both are
    refused before the lock is taken; a folder beside them is fine."""
    import argparse

    from mtk.checkpoint.resume import start_point

    data = tmp_path / "data"
    data.mkdir()
    (data / "rows.jsonl").write_text('{"text": "a"}\n')
    for output_dir, message in [
        (saved / "model", f"is inside the checkpoint {saved}"),
        (saved, f"is inside the checkpoint {saved}"),
        (data, "is inside the --data folder"),
        (data / "out", "is inside the --data folder"),
    ]:
        args = argparse.Namespace(output_dir=str(output_dir), resume=None, overwrite=False, data=str(data))
        with pytest.raises(CheckpointError, match=re.escape(message)):
            start_point(args, main_process=True)
        assert not (output_dir / ".mtk-run.lock").exists() and not (output_dir / "runs").exists()
    assert sorted(p.name for p in data.iterdir()) == ["rows.jsonl"]
    beside = argparse.Namespace(output_dir=str(tmp_path / "ckpts"), resume=None, overwrite=False, data=str(data))
    assert start_point(beside, main_process=True) is None


def test_an_overwrite_that_refuses_removed_nothing_first(saved, tmp_path):
    """--overwrite with a foreign step_N ahead: the run is refused before the earlier run's checkpoints go."""
    import argparse
    import shutil

    from mtk.checkpoint.lock import unlock_output_dir
    from mtk.checkpoint.resume import start_point

    runs = tmp_path / "ckpts"
    runs.mkdir()
    shutil.copytree(saved, runs / "step_2")
    (runs / "step_7").mkdir()
    (runs / "step_7" / "notes.txt").write_text("mine")
    args = argparse.Namespace(output_dir=str(runs), resume=None, overwrite=True)
    try:
        with pytest.raises(CheckpointError, match="step_7 exists and is not an mtk checkpoint"):
            start_point(args, main_process=True)
    finally:
        unlock_output_dir(runs)
    assert (runs / "step_2" / "metadata.json").is_file() and (runs / "step_7" / "notes.txt").read_text() == "mine"


def test_export_refuses_links_and_its_own_checkpoint_and_makes_an_ordinary_directory(saved, tmp_path):
    """An export target that is a link, or inside the checkpoint it reads, is refused before anything is
    written (no staging directory is left); a new export is a directory as mkdir makes one (umask applied)."""
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target", target_is_directory=True)
    with pytest.raises(CheckpointError, match="is a symbolic link; export into a new directory"):
        export_checkpoint(saved, tmp_path / "link", progress=False)
    with pytest.raises(CheckpointError, match="is inside the checkpoint"):
        export_checkpoint(saved, saved / "hf", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", saved.name, "target"]
    old = os.umask(0o027)
    try:
        out = export_checkpoint(saved, tmp_path / "hf", progress=False, verify=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o750


@pytest.mark.parametrize(
    "failure",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })"),
        RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file data/0"),
    ],
    ids=["os", "safetensors", "torch"],
)
def test_storage_errors_of_any_library_are_one_line_and_keep_older_checkpoints(
    saved, trained, tmp_path, monkeypatch, failure
):
    """A full or read-only disk, in the words of the OS, safetensors or torch, stops a save or an export with
    one line; the previous checkpoint stays complete and no partial directory is published."""
    parallel, model, optimizer = trained

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr("mtk.checkpoint.weights.save_file", fail)
    with pytest.raises(CheckpointError, match="cannot write checkpoint .*step_2.*previous checkpoints are untouched"):
        save_checkpoint(saved, parallel, model, [optimizer], [], step=2)
    monkeypatch.undo()
    assert _load(saved, trained) is not None  # still complete and verified
    monkeypatch.setattr("mtk.checkpoint.export.save_file", fail)
    with pytest.raises(CheckpointError, match="cannot write .*hf: .*nothing was written"):
        export_checkpoint(saved, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob("hf.*"))


def test_a_resume_must_keep_the_options_that_decide_the_data_and_the_adapters(tmp_path):
    """An option the guard holds changed on resume is refused like a changed --seq_len (--tokenizer, classify.py's
    --max_length); a model path written another way (``dir/``, ``./dir``) is the same model. The scripts' --lora_*
    flags are no longer held as typed (``v_proj,q_proj`` is ``q_proj,v_proj``): the adapters' PEFT configs are
    compared on every path (test_adapter_settings_that_differ_from_the_checkpoints_are_one_line)."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    saved = ResumeGuard(model=f"{model_dir}/", seq_len=128, lora_r=8, lora_alpha=16.0).state_dict()
    ResumeGuard(model=str(model_dir), seq_len=128, lora_r=8, lora_alpha=16.0).load_state_dict(saved)
    with pytest.raises(CheckpointError, match="changes --lora_alpha 16.0 -> 32.0 from the checkpoint"):
        ResumeGuard(model=str(model_dir), seq_len=128, lora_r=8, lora_alpha=32.0).load_state_dict(saved)
    ResumeGuard(model=str(model_dir), seq_len=128, lora_r=8, lora_alpha=16.0, packing=True).load_state_dict(saved)
    # another tokenizer gives the same ids other meanings; classify.py's --max_length is its --seq_len
    with pytest.raises(CheckpointError, match="changes --tokenizer bytes -> "):
        ResumeGuard(tokenizer=str(model_dir)).load_state_dict(ResumeGuard(tokenizer="bytes").state_dict())
    with pytest.raises(CheckpointError, match="changes --max_length 64 -> 8"):
        ResumeGuard(max_length=8).load_state_dict(ResumeGuard(max_length=64).state_dict())
    # the tokenizer is compared as the one the script reads: a built-in config's default is --tokenizer bytes, a
    # model directory's default its own tokenizer (older checkpoints recorded None and resume as they did)
    ResumeGuard(model="tiny-llama", tokenizer="bytes").load_state_dict({"model": "tiny-llama", "tokenizer": None})
    ResumeGuard(model="tiny-llama", tokenizer=None).load_state_dict(
        ResumeGuard(model="tiny-llama", tokenizer="bytes").state_dict()
    )
    ResumeGuard(model=str(model_dir), tokenizer=str(model_dir)).load_state_dict(
        ResumeGuard(model=str(model_dir), tokenizer=None).state_dict()
    )
    with pytest.raises(CheckpointError, match="changes --tokenizer .*model -> bytes"):
        ResumeGuard(model=str(model_dir), tokenizer="bytes").load_state_dict(
            ResumeGuard(model=str(model_dir), tokenizer=None).state_dict()
        )
    # --loss_on decides nothing on plain text rows: changed there, it is no other stream (on chat rows it is)
    import argparse

    was, now = (argparse.Namespace(loss_on=side, seq_len=8) for side in ("assistant", "all"))
    ResumeGuard.from_args(now, "text").load_state_dict(ResumeGuard.from_args(was, "text").state_dict())
    with pytest.raises(CheckpointError, match="changes --loss_on assistant -> all"):
        ResumeGuard.from_args(now, "messages").load_state_dict(ResumeGuard.from_args(was, "messages").state_dict())
    assert ResumeGuard.absent_from_older_checkpoints  # a checkpoint from before the script registered one resumes


def test_a_resume_refuses_a_model_directory_whose_config_changed(tmp_path):
    """The same --model directory with another config.json (an MoE's num_experts_per_tok 2 -> 8: the same weights,
    another routing) would continue another model without a word; the guard keeps the file's digest."""
    import argparse

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "qwen3_moe", "num_experts_per_tok": 2}')
    args = argparse.Namespace(model=str(model_dir), seq_len=128)
    saved = ResumeGuard.from_args(args).state_dict()
    ResumeGuard.from_args(args).load_state_dict(saved)
    (model_dir / "config.json").write_text('{"model_type": "qwen3_moe", "num_experts_per_tok": 8}')
    with pytest.raises(CheckpointError, match="has another config.json than when the checkpoint it resumes"):
        ResumeGuard.from_args(args).load_state_dict(saved)
    ResumeGuard.from_args(args).load_state_dict({"model": str(model_dir), "seq_len": 128})  # an older checkpoint
    as_file = argparse.Namespace(model=str(model_dir / "config.json"), seq_len=128)  # --model a config file
    saved = ResumeGuard.from_args(as_file).state_dict()
    (model_dir / "config.json").write_text('{"model_type": "qwen3_moe", "num_experts_per_tok": 2}')
    with pytest.raises(CheckpointError, match="has another config.json than when the checkpoint it resumes"):
        ResumeGuard.from_args(as_file).load_state_dict(saved)


def test_a_resume_refuses_data_files_changed_since_the_checkpoint(tmp_path):
    """Rows appended to --data's file (or a file added to its folder) shift every position after the
    checkpoint's: refused in one line; the same contents copied elsewhere keep their digest."""
    import argparse

    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a"}\n')
    saved = ResumeGuard.from_args(argparse.Namespace(data=str(data), seq_len=8)).state_dict()
    ResumeGuard.from_args(argparse.Namespace(data=str(data), seq_len=8)).load_state_dict(saved)
    with open(data, "a") as handle:
        handle.write('{"text": "b"}\n')
    with pytest.raises(CheckpointError, match=r"changes the files of --data .*data.jsonl \(rows added"):
        ResumeGuard.from_args(argparse.Namespace(data=str(data), seq_len=8)).load_state_dict(saved)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "a"}\n')
    before = data_fingerprint(folder)
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "a.jsonl").write_text('{"text": "a"}\n')
    assert data_fingerprint(copy) == before
    (folder / ".notes.swp").write_text("an editor's")  # not read by --data: not part of its digest
    assert data_fingerprint(folder) == before
    (folder / "b.jsonl").write_text("")
    assert data_fingerprint(folder) != before
    (folder / "c\udcff.jsonl").write_text("")  # a name whose bytes are not UTF-8 is read, and digested, as is
    assert data_fingerprint(folder) not in (before, data_fingerprint(copy))
    from datasets import Dataset  # a save_to_disk folder: the arrow files its state.json lists, not map's caches

    Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(str(tmp_path / "saved"))
    saved = data_fingerprint(tmp_path / "saved")
    (tmp_path / "saved" / "cache-0123.arrow").write_bytes(b"a map's cache")
    assert data_fingerprint(tmp_path / "saved") == saved


class _OneProcess:
    """What save_pretrained asks of an Accelerator, for one process."""

    is_main_process = True

    def get_state_dict(self, model):
        return model.state_dict()

    def unwrap_model(self, model):
        return model


def test_save_model_never_deletes_or_silently_skips(tmp_path):
    """--save_model into a folder holding a user's weight shards is refused before training (transformers' clean-up
    would delete them), and so is a file or a link, or the run's --output_dir or a step_N in it (which the run fills);
    a new directory gets the model and the tokenizer, whole. A target that cannot be written is refused then too."""
    theirs = tmp_path / "mine"
    theirs.mkdir()
    (theirs / "model-00001-of-00003.safetensors").write_bytes(b"user's")
    with pytest.raises(CheckpointError, match="already exists and is not empty"):
        check_target(theirs)
    assert (theirs / "model-00001-of-00003.safetensors").read_bytes() == b"user's"
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        check_target(tmp_path / "file")
    for inside in ("ckpts", "ckpts/step_60", "ckpts/runs", "ckpts/../ckpts/step_2"):  # filled by the run itself
        with pytest.raises(CheckpointError, match="is where the run writes its own checkpoints or logs"):
            check_target(tmp_path / inside, tmp_path / "ckpts")
    check_target(tmp_path / "ckpts" / "final", tmp_path / "ckpts")
    # a folder that cannot be written (here: a path under a file; a read-only file system alike), before training
    with pytest.raises(CheckpointError, match=r"cannot write .*file/sub/model: Not a directory in .*file; choose"):
        check_target(tmp_path / "file" / "sub" / "model")
    with pytest.raises(CheckpointError, match="cannot write"):  # as the main process, which writes, sees it
        check_target(tmp_path / "file" / "sub" / "model", accelerator=_OneProcess())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "mine"]  # the probes made nothing that stays
    check_no_shards_to_clean(tmp_path / "absent")  # classify.py's target: what HF's own save would delete
    check_no_shards_to_clean(tmp_path / "ckpts")
    with pytest.raises(CheckpointError, match=r"holds weight shards \(model-00001-of-00003.safetensors\)"):
        check_no_shards_to_clean(theirs)
    out = save_pretrained(_OneProcess(), build_model("tiny-llama"), tmp_path / "hf", ByteTokenizer())
    assert sorted(p.name for p in out.iterdir()) == [
        "byte_tokenizer.json", "config.json", "generation_config.json", "model.safetensors"
    ]  # fmt: skip
    assert not list(tmp_path.glob("hf.*.incomplete"))


def _pieces_checkpoint(root, runs):
    """A (tp 1, pp 1) checkpoint of one 2 x 3 tensor saved as FSDP2 pieces ``runs``: ``(start, stop)`` each."""
    from safetensors.torch import save_file

    from mtk.checkpoint.meta import CheckpointMeta
    from mtk.parallel.layout import Layout

    full = torch.arange(6.0).reshape(2, 3)
    (root / "model").mkdir(parents=True)
    for index, (start, stop) in enumerate(runs):
        spec = {"full_shape": [2, 3], "dim": None, "ranges": [], "local_size": None}
        spec.update(flat=[start, stop], shard_shape=[2, 3])
        save_file(
            {"w": full.reshape(-1)[start:stop].clone()},
            str(root / f"model/tp00-pp00-piece{index:02d}.safetensors"),
            metadata={"mtk_specs": json.dumps({"w": spec})},
        )
    return CheckpointMeta(step=1, topology=Layout(world_size=len(runs), tp_size=1, pp_size=1), pieces=len(runs)), full


@pytest.mark.parametrize(
    "runs,problem",
    [
        ([(0, 3), (3, 6)], None),
        ([(3, 6), (0, 3)], None),
        ([(0, 6)], None),  # ZeRO-3 at DP = 1: one piece, still a piece file holding a flat run
        ([(0, 2), (3, 6)], "do not join"),
        ([(0, 4), (3, 6)], "do not join"),
        ([(0, 3), (3, 5)], "hold 5 of 6"),
    ],
    ids=["in_order", "any_order", "one_piece", "gap", "overlap", "short"],
)
def test_pieces_join_into_their_shard_or_are_refused(tmp_path, runs, problem, capsys):
    """FSDP2's and EP's pieces: joined in element order whatever their files' order; a gap, an overlap or a missing
    tail is one line, from a reader and from ``mtk verify-checkpoint`` (whose checksums alone would pass a crafted
    checkpoint listing these files), which reads only the headers."""
    from mtk.checkpoint.reader import ShardedCheckpointReader

    meta, full = _pieces_checkpoint(tmp_path, runs)
    with ShardedCheckpointReader(tmp_path, meta) as reader:
        if problem is None:
            assert torch.equal(reader.full("w"), full)
        else:
            with pytest.raises(CheckpointError, match=problem):
                reader.full("w")
    meta.files = {f"model/{p.name}": _record(p) for p in sorted((tmp_path / "model").iterdir())}
    (tmp_path / "metadata.json").write_text(meta.to_json())
    code, out, err = _verify_cli(tmp_path, capsys)
    if problem is None:
        assert code == 0 and ": ok, " in out
    else:
        assert code == 2 and problem in err and "\n" not in err.strip()


def _tp_checkpoint(root, shards, stored=None):
    """A (tp 2, pp 1) checkpoint of one 4 x 3 tensor split on rows: shard ``t`` claims rows ``shards[t]`` and holds
    ``stored[t]`` rows (its claim's by default), every file listed with a matching checksum."""
    from safetensors.torch import save_file

    from mtk.checkpoint.meta import CheckpointMeta
    from mtk.parallel.layout import Layout

    (root / "model").mkdir(parents=True)
    for t, (start, stop) in enumerate(shards):
        rows = (stored or {}).get(t, stop - start)
        spec = {"full_shape": [4, 3], "dim": 0, "ranges": [[start, stop]], "local_size": None}
        path = root / f"model/tp{t:02d}-pp00.safetensors"
        save_file({"w": torch.zeros(rows, 3)}, str(path), metadata={"mtk_specs": json.dumps({"w": spec})})
    meta = CheckpointMeta(step=1, topology=Layout(world_size=2, tp_size=2, pp_size=1))
    meta.files = {f"model/{p.name}": _record(p) for p in sorted((root / "model").iterdir())}
    (root / "metadata.json").write_text(meta.to_json())


@pytest.mark.parametrize(
    "shards,stored,problem",
    [
        ([(0, 2), (2, 4)], None, None),
        ([(0, 2), (0, 2)], None, "hold 2 of its 4 entries along dimension 0"),
        ([(0, 2), (2, 4)], {1: 1}, "holds 'w' as (1, 3), its spec says (2, 3)"),
        ([(0, 2), (2, 9)], {1: 7}, "reaches outside it"),
    ],
    ids=["whole", "uncovered", "short_shard", "outside"],
)
def test_verify_checkpoint_checks_that_the_shards_cover_each_tensor(tmp_path, capsys, shards, stored, problem):
    """Checksums prove the files are the ones recorded, not that they hold a whole model: a crafted (or wrongly
    written) layout is one line from ``mtk verify-checkpoint``, not found only when an export reaches the tensor."""
    _tp_checkpoint(tmp_path, shards, stored)
    code, out, err = _verify_cli(tmp_path, capsys)
    if problem is None:
        assert code == 0 and ": ok, 2 files" in out
    else:
        assert code == 2 and problem in err and "\n" not in err.strip()


@pytest.mark.parametrize("delay", [0.5, 1.0, 1.5, 2.5, 4.0])
def test_ctrl_c_to_an_mtk_command_is_one_line(saved, tmp_path, delay):
    """SIGINT to ``mtk export`` while it imports, verifies or writes: exit status 130 and one line, no traceback and no
    staging directory left (the package imports nothing heavy before the command's handler is in place). A command
    that finished first exits 0 (or, if the signal lands while the interpreter shuts down, as Python's SIGINT)."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "hf"
    command = [sys.executable, "-m", "mtk.cli.main", "export", str(saved), str(out)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert "Traceback" not in stderr, stderr[-3000:]
    if process.returncode in (0, -signal.SIGINT):  # finished; or SIGINT came as the interpreter shut down after it
        assert "verified" in stdout, (process.returncode, stdout, stderr[-2000:])
    else:
        # a progress bar (the export's, transformers' loading) may have started before the signal; it is closed
        # before the one line, which therefore starts a line of its own ("\r" splits lines too)
        lines = [line for line in stderr.splitlines() if line.strip() and "%|" not in line]
        assert process.returncode == 130 and lines == [
            "mtk: interrupted (SIGINT); stopped, nothing half-written is left"
        ], stderr
        # stopped before the export was moved into place (nothing there), or just after (it is whole)
        assert not out.exists() or {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
        assert not list(tmp_path.glob("hf*.incomplete"))


def test_a_step_folder_whose_metadata_records_another_step_is_refused(saved, tmp_path):
    """``--resume auto`` takes the newest ``step_N`` by its name: a copy of step 2 named step_7 would be taken for
    the newest (the run's own step_3 ignored) and continued from step 2; auto and an explicit resume refuse it."""
    import argparse
    import shutil

    from mtk.checkpoint.resume import start_point

    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(saved, out / "step_2")
    shutil.copytree(saved, out / "step_7")
    for resume in ("auto", str(out / "step_7")):
        args = argparse.Namespace(output_dir=str(out), resume=resume, overwrite=False)
        with pytest.raises(CheckpointError, match="step_7 records step 2, not 7: a copy or a renamed checkpoint"):
            start_point(args, main_process=True)
    (out / "step_7").rename(out / "copy_of_2")  # any other name resumes from what it records
    args = argparse.Namespace(output_dir=str(out), resume=str(out / "copy_of_2"), overwrite=False)
    assert start_point(args, main_process=True) == str(out / "copy_of_2")


def _rewrite_header(path, change) -> None:
    """``path``'s safetensors header as ``change`` rewrites its JSON text, the tensor bytes kept."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    text = change(raw[8 : 8 + length].decode().rstrip())
    header = text.encode() + b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + length :])


def _retype_first_float(text: str) -> str:
    header = json.loads(text)
    name = next(n for n, info in header.items() if n != "__metadata__" and info["dtype"] == "F32")
    header[name]["dtype"] = "I32"  # the same bytes read as integers: 1e9 weights
    return json.dumps(header)


def _alias_a_tensor(text: str) -> str:
    header = json.loads(text)
    names = [n for n in header if n != "__metadata__"]
    same = next(b for b in names[1:] if header[b]["shape"] == header[names[0]]["shape"])
    return text[:-1] + f", {json.dumps(names[0])}: {json.dumps(header[same])}}}"  # a second entry: the last wins


def _specs_as_an_object(text: str) -> str:
    header = json.loads(text)
    header["__metadata__"]["mtk_specs"] = json.loads(header["__metadata__"]["mtk_specs"])  # not a string
    return json.dumps(header)


def _fractional_shape(text: str) -> str:
    header = json.loads(text)
    specs = json.loads(header["__metadata__"]["mtk_specs"])
    first = next(iter(specs.values()))
    first["full_shape"] = [n + 0.5 for n in first["full_shape"]]
    header["__metadata__"]["mtk_specs"] = json.dumps(specs)
    return json.dumps(header)


@pytest.mark.parametrize(
    "change, message",
    [
        (_retype_first_float, "is stored as int32"),
        (_alias_a_tensor, "is given twice|invalid offset"),
        (_specs_as_an_object, "has no mtk shard specs|not a readable safetensors file"),
    ],
    ids=["float-retyped-int", "duplicate-key", "specs-not-a-string"],
)
def test_a_crafted_header_whose_checksum_matches_is_refused(saved, trained, tmp_path, capsys, change, message):
    """A weights file whose header was rewritten with its checksum (a float tensor retyped ``I32``, a second entry
    under one name aliasing another tensor's bytes) is refused by resume, export and verify-checkpoint: not trained
    on, not exported as "verified" (resume reads through safetensors' own parser, which refuses the alias too)."""
    _rewrite_header(saved / SHARD, change)
    _rewrite_metadata(saved, lambda meta: meta["files"].update({SHARD: _record(saved / SHARD)}))
    for said in _refusals(saved, trained, tmp_path, capsys):
        assert re.search(message, said), said
    assert not (tmp_path / "out").exists()


def test_weights_holding_nan_or_infinity_are_not_saved(tmp_path, trained):
    """A whole checkpoint of NaN weights verified ok and resumed into NaN losses (a weight decay of 1e400, a damaged
    optimizer state resumed: the loss and gradient norm of the step were still finite). Saving refuses it in one line
    naming the tensor, and writes nothing."""
    import copy

    parallel, model, optimizer = trained
    damaged = copy.deepcopy(model)
    name, param = next(iter(damaged.named_parameters()))
    with torch.no_grad():
        param.view(-1)[0] = float("nan")
    with pytest.raises(CheckpointError, match=rf"step 3: {re.escape(name)} holds NaN or infinity, so it is not saved"):
        save_checkpoint(tmp_path / "step_3", parallel, damaged, [optimizer], [], step=3)
    assert list(tmp_path.iterdir()) == []


def _set_json(key, value):
    def change(groups):
        groups[key] = value

    return change


def _set_group(key, value):
    def change(groups):
        groups["param_groups"][0][key] = value

    return change


def _rewrite_moments(change):
    """A damage: ``change`` applied to the optimizer file's tensors (a dict), the file rewritten in place (its header's
    save label kept); returns its path."""

    def damage(directory):
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        path = directory / "optimizer/tp00-pp00.safetensors"
        with safe_open(str(path), "pt") as handle:
            header = handle.metadata()
        tensors = load_file(str(path))
        change(tensors)
        save_file(tensors, str(path), metadata=header)
        return path

    return damage


def _one_step_set_to(value):
    def change(tensors):
        key = next(k for k in sorted(tensors) if k.endswith("::step"))
        tensors[key] = torch.full_like(tensors[key], value)

    return change


def _reorder_params(change):
    """A damage: the JSON's parameter list reordered by ``change`` (torch pairs the groups' parameters by
    position: moments met parameters of another shape, a traceback at the first step)."""

    def damage(groups):
        groups["param_groups"][0]["params"] = change(groups["param_groups"][0]["params"])

    damage.__name__ = "change"  # (a JSON damage, applied as _set_group's are)
    return damage


def _reshape_a_moment(tensors):
    name = next(k for k, v in tensors.items() if k.endswith("::exp_avg") and v.dim() == 2)
    tensors[name] = tensors[name].reshape(-1, 2)


def _steps_shaped_as_moments(tensors):
    for key in [k for k in tensors if k.endswith("::step")]:
        tensors[key] = torch.full_like(tensors[key.replace("::step", "::exp_avg")], 1.0)


def _steps_as(dtype):
    def change(tensors):
        for key in [k for k in tensors if k.endswith("::step")]:
            tensors[key] = tensors[key].to(dtype)

    return change


def _steps_set_to(value):
    def change(tensors):
        for key in [k for k in tensors if k.endswith("::step")]:
            tensors[key] = torch.full_like(tensors[key], value)

    return change


@pytest.mark.parametrize(
    "damage, message",
    [
        (_set_group("betas", [1.0, 1.0]), "settings saved in the checkpoint are ones AdamW refuses"),
        (_set_group("eps", "x"), "settings saved in the checkpoint are ones AdamW refuses"),
        (_set_group("weight_decay", float("nan")), "settings saved in the checkpoint are ones AdamW refuses"),
        (_rewrite_moments(_reshape_a_moment), "'exp_avg' of .* has shape"),
        (_rewrite_moments(_steps_set_to(float("nan"))), "'step' of .* holds NaN or infinity"),
        (_rewrite_moments(_steps_set_to(-5.0)), "step of .* is negative"),
        (_set_group("amsgrad", True), "lacks 'max_exp_avg_sq', which AdamW keeps with the settings saved beside it"),
        (_rewrite_moments(_steps_set_to(1000.0)), "optimizer state counts 1000 steps where its metadata recorded 1"),
        (_set_group("lr", 5.0), r"learning rates \[5.0\] are not the \[0.001\] its metadata recorded"),
        (_rewrite_moments(_one_step_set_to(0.0)), "optimizer state counts at fewest 0 steps where its metadata"),
        (
            _reorder_params(lambda names: [names[1], names[0], *names[2:]]),
            "lists the optimizer's parameters otherwise",
        ),
        (_reorder_params(lambda names: [names[0], *names[:-1]]), "lists the optimizer's parameters otherwise"),
        (_set_json("param_groups", ["x"]), "param_groups is not a list of objects"),  # (AttributeError tracebacks)
        (_set_json("state", []), "state is not an object of parameter names"),
        (_rewrite_moments(_steps_set_to(1.9)), "optimizer state counts 2 steps where its metadata recorded 1"),
        (_rewrite_moments(_steps_shaped_as_moments), r"step of .* is not one count \(shape \("),
        (_rewrite_moments(_steps_as(torch.bool)), r"step of .* is not one count \(shape \(\), torch.bool\)"),
        (_set_group("lr", "0.001"), "settings saved in the checkpoint are ones AdamW refuses"),
    ],
    ids=[
        "betas-1",
        "eps-string",
        "weight-decay-nan",
        "moment-reshaped",
        "step-nan",
        "step-negative",
        "amsgrad",
        "steps-of-another-save",
        "lr-of-another-save",
        "one-step-of-another-save",
        "params-swapped",
        "params-duplicated",
        "groups-of-strings",
        "state-a-list",
        "steps-fractional",  # (Adam's bias correction from 1.9: counted as its floor it passed for 1)
        "lr-a-string",  # (verify compared float("0.001") with the record: test_learning_rates_are_numbers)
        "steps-shaped-as-moments",  # (a traceback inside Adam's step)
        "steps-bool",  # (a traceback inside Adam's step)
    ],
)
def test_a_crafted_optimizer_state_is_refused_when_resumed(saved, trained, damage, message):
    """An optimizer state its own constructor would refuse, or moments not shaped like their parameter, loaded
    without a word and failed at the first step (a ZeroDivisionError, a TypeError, a shape mismatch) or trained into
    NaN weights with exit 0. Checked before it is loaded: one line."""
    if callable(damage) and damage.__name__ == "change":
        path = saved / "optimizer/tp00-pp00.json"
        groups = json.loads(path.read_text())
        damage(groups)
        path.write_text(json.dumps(groups))
    else:
        path = damage(saved)
    name = str(path.relative_to(saved))
    _rewrite_metadata(saved, lambda meta: meta["files"].update({name: _record(path)}))
    with pytest.raises(CheckpointError, match=message) as err:
        _load(saved, trained)
    assert "\n" not in str(err.value)


def test_verify_checkpoint_refuses_an_optimizer_list_naming_a_parameter_twice_or_one_not_held(saved, capsys):
    """Resume refused a parameter listed twice in the optimizer's JSON (torch pairs by position); verify called it
    ok. Verify now checks each name is listed once and is a tensor of its rank's weights file (the order is the
    run's, which only a resume knows)."""
    path = saved / "optimizer/tp00-pp00.json"
    original = path.read_text()
    for change, said in [
        (lambda params: params.__setitem__(1, params[0]), "twice"),
        (
            lambda params: params.__setitem__(0, "model.no_such.weight"),
            "'model.no_such.weight', which model/tp00-pp00",
        ),
    ]:
        record = json.loads(original)
        change(record["param_groups"][0]["params"])
        path.write_text(json.dumps(record))
        _rewrite_metadata(saved, lambda meta: meta["files"].update({"optimizer/tp00-pp00.json": _record(path)}))
        code, _, err = _verify_cli(saved, capsys)
        assert code == 2 and said in err and "\n" not in err.strip(), err
    path.write_text(original)
    _rewrite_metadata(saved, lambda meta: meta["files"].update({"optimizer/tp00-pp00.json": _record(path)}))
    assert _verify_cli(saved, capsys)[0] == 0


def test_a_scheduler_state_of_another_shape_is_refused_and_a_changed_setting_said(tmp_path, trained, capsys):
    """Two ``base_lrs`` for one parameter group failed at the first step (``zip``); a setting the checkpoint restores
    over this run's (a weight decay, a learning rate changed on resume) is said, as accelerate's load_state restores
    them, not silently."""
    parallel, model, optimizer = trained
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    directory = save_checkpoint(tmp_path / "step_2", parallel, model, [optimizer], [scheduler], step=2)
    resumed = torch.optim.AdamW(model.parameters(), lr=0.3, weight_decay=0.5)
    again = torch.optim.lr_scheduler.LambdaLR(resumed, lambda step: 1.0)
    load_checkpoint(directory, parallel, model, [resumed], [again])
    said = capsys.readouterr().out
    assert "mtk: the checkpoint's optimizer weight_decay=0.01 is restored over this run's 0.5" in said
    assert "mtk: the checkpoint's learning rate [0.001] is restored over this run's [0.3]" in said
    path = directory / "scheduler.pt"
    original = torch.load(path, weights_only=True)
    for change, message in [
        ({"base_lrs": [0.001, 0.001]}, r"'base_lrs' holds 2 values, this run's scheduler 1"),
        ({"base_lrs": [-0.001]}, r"'base_lrs' holds a negative value"),  # trained by gradient ascent, said only
        ({"last_epoch": -7, "_step_count": -6}, r"'last_epoch' is -7; a count of steps is not negative"),
        # valid alone, not with the save that recorded position 0: the learning rate of another step
        ({"last_epoch": 100, "_step_count": 101}, r"scheduler 0 is at position 100 where the metadata recorded 0"),
        # valid alone, not with the optimizer saved beside it (its groups started from 0.001): 10,000x the rate
        ({"base_lrs": [30.0]}, r"base learning rates \[30.0\] are not the \[0.001\] its optimizer's saved groups"),
    ]:
        torch.save({**original, **change}, path)
        record = {str(path.relative_to(directory)): _record(path)}
        _rewrite_metadata(directory, lambda meta, record=record: meta["files"].update(record))
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint(directory, parallel, model, [resumed], [again])
        if "last_epoch" in change or change.get("base_lrs") == [30.0]:  # what verify can tell without the run
            code, _, said = _verify_cli(directory, capsys)
            assert code == 2 and ("position" in said or "scheduler.pt does not hold what this run loads" in said), said


def test_verify_checkpoint_refuses_an_rng_state_resume_cannot_set(saved, trained, capsys):
    """A truncated torch RNG state (its checksum rewritten) was refused by resume in one line, and called ok by
    verify-checkpoint; verify now sets each rank's states as resume does, and puts its own back."""
    path = saved / "rng" / "rank00000.pt"
    states = torch.load(path, weights_only=True)
    torch.save({**states, "torch": states["torch"][:100]}, path)
    _rewrite_metadata(saved, lambda meta: meta["files"].update({"rng/rank00000.pt": _record(path)}))
    before = torch.get_rng_state()
    code, _, said = _verify_cli(saved, capsys)
    assert code == 2 and "rng/rank00000.pt does not hold what this run loads from it" in said, said
    assert torch.equal(torch.get_rng_state(), before)
    with pytest.raises(CheckpointError, match="rng/rank00000.pt does not hold what this run loads from it"):
        _load(saved, trained)


def test_a_data_position_that_is_not_a_count_or_disagrees_with_itself_is_refused():
    """``micro_batches: -1`` in the metadata resumed at another data position without a word, and so did a
    ``samples_per_micro_batch`` of 4 where the run saved 8 (half the data it had consumed skipped): the record
    carries the samples consumed, their product, and each count must agree with it."""
    from mtk.checkpoint.resume import data_position, rescaled_position

    assert rescaled_position(data_position(6, 4), 8) == 3
    assert rescaled_position({"micro_batches": 6, "samples_per_micro_batch": 4}, 8) == 3  # saved before the record
    for data in ({"micro_batches": -1}, {"micro_batches": 2.5}, {"micro_batches": 2, "samples_per_micro_batch": -4}):
        with pytest.raises(CheckpointError, match="data position .* not a count"):
            rescaled_position(data, 4)
    for edited in ({"samples_per_micro_batch": 4}, {"micro_batches": 3}, {"samples": 32}):
        with pytest.raises(CheckpointError, match="data position disagrees with itself"):
            rescaled_position({**data_position(2, 8), **edited}, 8)


def test_shard_specs_of_fractional_sizes_are_refused_by_verify_and_export(saved, tmp_path, capsys):
    """A spec's sizes are whole numbers: ``130.5`` was cut to 130 by ``int`` or failed as a slice index (a
    TypeError traceback in verify-checkpoint and export). Resume at the same layout reads tensors, not specs."""
    _rewrite_header(saved / SHARD, _fractional_shape)
    _rewrite_metadata(saved, lambda meta: meta["files"].update({SHARD: _record(saved / SHARD)}))
    with pytest.raises(CheckpointError, match=r"malformed mtk shard specs \(ValueError: .*\.5 is not a whole number"):
        export_checkpoint(saved, tmp_path / "out")
    code, _, said = _verify_cli(saved, capsys)
    assert code == 2 and "is not a whole number" in said and "\n" not in said.strip()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_a_parameter_stored_in_another_float_dtype_is_refused_on_resume(saved, trained, tmp_path, capsys, dtype):
    """A shard re-saved with a tensor in float16 or float8 (its checksum rewritten) resumed silently on rounded
    weights; float8 also made export's merge raise. Resume wants the parameter's own dtype; verify and export refuse
    float8, which mtk never saves."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(saved / SHARD), "pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(saved / SHARD))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(dtype)
    save_file(tensors, str(saved / SHARD), metadata=metadata)
    _rewrite_metadata(saved, lambda meta: meta["files"].update({SHARD: _record(saved / SHARD)}))
    shown = str(dtype).removeprefix("torch.")
    with pytest.raises(CheckpointError, match=f"model.norm.weight is stored as {shown}, this run's model holds it as"):
        _load(saved, trained)
    if dtype == torch.float8_e4m3fn:
        for said in _refusals(saved, trained, tmp_path, capsys)[1:]:
            assert "mtk saves fp64, fp32, bf16, fp16" in said, said


def test_learning_rates_are_numbers():
    """What verify-checkpoint reads of an optimizer JSON: a rate written as text equalled its record as a float."""
    from mtk.checkpoint.counts import learning_rates

    assert learning_rates([{"lr": 0.5}, {"lr": torch.tensor(0.25)}]) == [0.5, 0.25]
    with pytest.raises(CheckpointError, match="a learning rate '0.001' is not a number"):
        learning_rates([{"lr": "0.001"}])


@pytest.mark.parametrize("position", [100.0, torch.tensor(100)], ids=["float", "tensor"])
def test_a_scheduler_position_of_another_type_is_not_the_recorded_null(tmp_path, trained, position):
    """``scheduler_positions: [null]`` beside a ``scheduler.pt`` at ``100.0`` (or a tensor): read back through the
    recording rule, any position not an int became ``None`` and equalled the null (the scheduler then ran at 100)."""
    parallel, model, optimizer = trained
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    directory = save_checkpoint(tmp_path / "step_2", parallel, model, [optimizer], [scheduler], step=2)
    path = directory / "scheduler.pt"
    state = torch.load(path, weights_only=True)
    state.update(last_epoch=position, _step_count=101)
    torch.save(state, path)
    _rewrite_metadata(directory, lambda meta: meta["counts"].update(scheduler_positions=[None]))
    _rewrite_metadata(directory, lambda meta: meta["files"].update({"scheduler.pt": _record(path)}))
    with pytest.raises(CheckpointError, match="scheduler 0 is at position .*100.* where the metadata recorded None"):
        load_checkpoint(directory, parallel, model, [optimizer], [scheduler])


def test_base_lrs_beside_groups_without_their_initial_lr_are_refused(tmp_path, trained, capsys):
    """``base_lrs`` of 0.03 with every group's ``initial_lr`` removed from the optimizer JSON (labels kept): the
    comparison skipped groups without one and trained at 10x the rate, only "restored" in a line (the sixth re-check's
    borderline case). A scheduler built on the optimizer sets every group's."""
    parallel, model, optimizer = trained
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    directory = save_checkpoint(tmp_path / "step_2", parallel, model, [optimizer], [scheduler], step=2)
    path = directory / "scheduler.pt"
    torch.save({**torch.load(path, weights_only=True), "base_lrs": [0.03]}, path)
    groups_path = directory / "optimizer/tp00-pp00.json"
    groups = json.loads(groups_path.read_text())
    for group in groups["param_groups"]:
        group.pop("initial_lr")
    groups_path.write_text(json.dumps(groups))
    records = {name: _record(directory / name) for name in ("scheduler.pt", "optimizer/tp00-pp00.json")}
    _rewrite_metadata(directory, lambda meta: meta["files"].update(records))
    with pytest.raises(CheckpointError, match=r"base learning rates \[0.03\] are not the \[None\]"):
        load_checkpoint(directory, parallel, model, [optimizer], [scheduler])


def test_adapter_settings_that_differ_from_the_checkpoints_are_one_line():
    """Any PEFT config (the Trainer's ``peft_config``, a user's ``get_peft_model``), not only mtk's scripts'
    ``--lora_*`` flags: a setting that changes what the adapters compute, or other adapter names, is refused."""
    from peft import LoraConfig, get_peft_model

    from mtk.checkpoint.base_model import check_adapter_settings
    from mtk.models import build_model
    from mtk.parallel.record import adapter_configs

    model = get_peft_model(build_model("tiny-llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    saved = adapter_configs(model)
    check_adapter_settings("ckpt", saved, model)
    check_adapter_settings("ckpt", None, model)  # (a full model's checkpoint: check_base says so)
    model.peft_config["default"].lora_alpha = 32
    with pytest.raises(CheckpointError, match=r"changes lora_alpha 8 -> 32 of the adapter 'default' from the check"):
        check_adapter_settings("ckpt", saved, model)
    model.peft_config["default"].lora_alpha = 8
    model.peft_config["default"].use_rslora = True
    with pytest.raises(CheckpointError, match=r"changes use_rslora False -> True"):
        check_adapter_settings("ckpt", saved, model)
    model.peft_config["default"].use_rslora = False
    model.peft_config["default"].inference_mode = True  # (not a training setting)
    check_adapter_settings("ckpt", saved, model)
    with pytest.raises(CheckpointError, match=r"holds the adapters \['other'\], this run has \['default'\]"):
        check_adapter_settings("ckpt", {"other": saved["default"]}, model)
    model.peft_config["default"].target_modules = r".*\.q_proj"  # the same modules, named by PEFT's regex
    check_adapter_settings("ckpt", saved, model)
    model.peft_config["default"].target_modules = r".*\.(q_proj|v_proj)"  # more modules
    with pytest.raises(CheckpointError, match=r"changes target_modules \['q_proj'\] -> "):
        check_adapter_settings("ckpt", saved, model)


def test_a_zero3_base_fingerprint_leaves_deepspeeds_unwritten_padding_out(monkeypatch):
    """DeepSpeed allocates a ZeRO-3 piece with ``torch.empty`` and never writes a frozen parameter's padding: a
    fingerprint that summed it changed from process to process (a resume refused as "another base"), and NaN there
    made every comparison pass."""
    import torch.distributed as dist

    from mtk.checkpoint import base_model

    param = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    param.ds_shape, param.ds_numel, param.ds_process_group = (5,), 5, None  # 5 elements over 2 ranks: 3 + 2
    param.ds_tensor = torch.tensor([3.0, 4.0, float("nan")])  # rank 1's piece: elements 3, 4 and padding
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    assert base_model._zero3_elements(param).tolist() == [3.0, 4.0]
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)  # 2 per rank: rank 3 starts past the end
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)
    param.ds_tensor = torch.tensor([float("nan"), float("nan")])
    assert len(base_model._zero3_elements(param)) == 0


def test_a_restored_schedule_sets_its_rate_at_its_position_tensor_rates_in_place():
    """A ``LambdaLR`` restored at position 4 of a schedule now 6 steps long: its rate is the new schedule's (the
    optimizer restored the old one's last, 0); a tensor rate (captured, fused) is changed in place; other schedulers
    (their rate depends on their past) stay as restored."""
    from mtk.checkpoint.schedules import follow_the_schedule

    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([weight], lr=torch.tensor(0.1))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / 6)
    captured = optimizer.param_groups[0]["lr"].fill_(0.0)  # the old schedule's last rate, as the optimizer restored
    schedule.last_epoch = 4
    follow_the_schedule(schedule)
    assert optimizer.param_groups[0]["lr"] is captured and captured.item() == pytest.approx(0.1 * (1 - 4 / 6))
    assert schedule.get_last_lr()[0].item() == captured.item()
    step = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([weight], lr=0.5), step_size=1)
    step.optimizer.param_groups[0]["lr"] = 0.25
    follow_the_schedule(step)
    assert step.optimizer.param_groups[0]["lr"] == 0.25


@pytest.mark.parametrize("kind", ["WarmupDecayLR", "WarmupCosineLR", "OneCycle"])
def test_a_restored_deepspeed_schedule_sets_its_rate_at_its_position(kind):
    """A DeepSpeed JSON scheduler (the Trainer's) restored after 4 steps of a run now 12 steps long ran its first step
    at the 6-step run's rate (DeepSpeed restores the position alone): it is this run's schedule's now, and bit for bit
    the restored one where the schedule is unchanged."""
    from deepspeed.runtime import lr_schedules

    from mtk.checkpoint.schedules import follow_the_schedule

    def schedule(total: int) -> object:
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
        if kind == "OneCycle":
            return lr_schedules.OneCycle(optimizer, 1e-4, 1e-3, cycle_first_step_size=total)
        return getattr(lr_schedules, kind)(optimizer, total_num_steps=total, warmup_num_steps=2)

    def rate(scheduler: object) -> float:
        return scheduler.optimizer.param_groups[0]["lr"]

    saved = schedule(6)
    for _ in range(4):
        saved.step()
    for total, expected in ((6, rate(saved)), (12, None)):
        resumed = schedule(total)
        resumed.optimizer.load_state_dict(saved.optimizer.state_dict())
        resumed.load_state_dict(saved.state_dict())
        follow_the_schedule(resumed)
        if expected is None:
            fresh = schedule(total)
            for _ in range(4):
                fresh.step()
            expected = rate(fresh)
            assert expected != rate(saved)
        assert rate(resumed) == expected


def test_a_dp_change_rescales_each_schedulers_own_position_and_leaves_deepspeeds_engine_alone():
    """At another DP size a prepared scheduler's position is converted (accelerate steps it once per replica); one
    that DeepSpeed's engine steps (once per optimizer step) raised an AttributeError on ``last_epoch`` at a ZeRO-3
    resume at another DP and would have been wrong to convert; DeepSpeed's scheduler classes count from -1."""
    from types import SimpleNamespace

    from accelerate.scheduler import AcceleratedScheduler
    from accelerate.utils import DeepSpeedSchedulerWrapper
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    from mtk.integrations.accelerate.checkpoint import ShardedCheckpointing

    def optimizer() -> torch.optim.Optimizer:
        return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)

    def stepped(scheduler, steps: int):
        for _ in range(steps):
            scheduler.step()
        return scheduler

    lambda_lr = stepped(torch.optim.lr_scheduler.LambdaLR(optimizer(), lambda step: 1.0), 6)
    warmup = stepped(WarmupDecayLR(optimizer(), total_num_steps=20), 6)
    engines = stepped(WarmupDecayLR(optimizer(), total_num_steps=20), 6)
    prepared = [
        AcceleratedScheduler(lambda_lr, lambda_lr.optimizer),
        AcceleratedScheduler(warmup, warmup.optimizer),
        DeepSpeedSchedulerWrapper(engines, engines.optimizer),
    ]
    host = SimpleNamespace(parallel=SimpleNamespace(dp_size=1), _schedulers=prepared)
    ShardedCheckpointing._rescale_schedulers(host, saved_dp=2)  # type: ignore[arg-type]
    assert lambda_lr.last_epoch == 3 and lambda_lr._step_count == 4
    assert warmup.last_batch_iteration == 2  # 3 steps taken
    assert engines.last_batch_iteration == 5  # as restored
    with pytest.raises(CheckpointError, match="has no position mtk can convert from the checkpoint's dp=2"):
        ShardedCheckpointing._rescale_schedulers(
            SimpleNamespace(parallel=SimpleNamespace(dp_size=1), _schedulers=[AcceleratedScheduler(object(), [])]),
            saved_dp=2,
        )  # type: ignore[arg-type]


def test_a_fifo_in_a_checkpoint_is_refused_without_being_opened(tmp_path):
    """Opening a FIFO blocks until someone writes to it: a format-1 checkpoint's labels were read from every file
    found (a hang of every rank), a format-2 one passed it over as no file ("ok")."""
    from mtk import jsonio
    from mtk.checkpoint.integrity import list_files, verify_files

    (tmp_path / "optimizer").mkdir()
    fifo = tmp_path / "optimizer" / "tp00-pp00.json"
    os.mkfifo(fifo)
    assert list_files(tmp_path) == []
    expected = [f"{fifo} is no regular file (a FIFO, socket or device); a checkpoint holds only its own files"]
    assert verify_files(tmp_path, {}, None, listed=list_files(tmp_path)) == expected
    assert verify_files(tmp_path, {}, None) == expected
    with pytest.raises(ValueError, match="no regular file"):
        jsonio.read(fifo)


def test_rotations_remove_only_readable_mtk_checkpoints_and_true_resumes_the_newest_of_them(tmp_path):
    """The Trainer's save_total_limit rotation removed a user's checkpoint-3 holding another tool's metadata.json
    (the thirty-ninth check's data loss, on the Trainer's side); a damaged one is not removed either (mtk cannot tell
    what it holds), and resume_from_checkpoint=True took transformers' highest checkpoint-N, another tool's."""
    from pathlib import Path

    from mtk.trainers.checkpoints import _newest_checkpoint, written_checkpoints

    ours = '{"format": "mtk-checkpoint/2"}'
    metadata = {"checkpoint-2": ours, "checkpoint-3": '{"tool": "other"}', "checkpoint-4": ours,
                "checkpoint-5": '{"format": "mtk-checkp'}  # fmt: skip
    for name, text in metadata.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metadata.json").write_text(text)
    assert [Path(f).name for f in written_checkpoints(str(tmp_path))] == ["checkpoint-2", "checkpoint-4"]
    assert Path(_newest_checkpoint(tmp_path)).name == "checkpoint-5"  # (damaged: resuming it says what is wrong)
    (tmp_path / "checkpoint-5" / "metadata.json").unlink()
    assert Path(_newest_checkpoint(tmp_path)).name == "checkpoint-4"
