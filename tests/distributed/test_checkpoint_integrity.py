"""A damaged shard that only one TP rank reads is found by every rank: all refuse with the same line
naming the file, none is left waiting in a collective."""

import json

import torch

from mtk.checkpoint import CheckpointError
from mtk.checkpoint.sharded import load_checkpoint, save_checkpoint
from mtk.convert import parallelize
from mtk.models import build_model
from mtk.parallel import ParallelState
from mtk.testing import run_distributed


def _saved(world_size: int, directory: str, *, stepped: bool = False):
    """A TP ``world_size`` tiny-llama and its AdamW saved at ``directory`` (after one step with ``stepped``)."""
    parallel = ParallelState.build(tp_size=world_size)
    model = parallelize(build_model("tiny-llama"), parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if stepped:
        ids = torch.tensor([[1, 2, 3, 4]])
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    return parallel, model, optimizer, save_checkpoint(directory, parallel, model, [optimizer], [], step=1)


def _load_or_refusal(directory: str, parallel, model, optimizer) -> str:
    """What loading ``directory`` says on this rank, after every rank has crafted its part."""
    torch.distributed.barrier()
    try:
        load_checkpoint(directory, parallel, model, [optimizer], [])
    except CheckpointError as err:
        return str(err)
    return "loaded"


def _rehash(path, name: str) -> None:
    """Record ``path / name``'s new size and checksum in the checkpoint's metadata (what a crafted file carries)."""
    import json

    from mtk.checkpoint.integrity import file_checksum

    meta = json.loads((path / "metadata.json").read_text())
    meta["files"][name] = {"bytes": (path / name).stat().st_size, "xxh3_128": file_checksum(path / name)}
    (path / "metadata.json").write_text(json.dumps(meta))


def _save_damage_load(rank: int, world_size: int, directory: str) -> str:
    parallel, model, optimizer, path = _saved(world_size, directory)
    if rank == 0:
        shard = path / "model" / "tp01-pp00.safetensors"  # read by TP rank 1 only
        data = bytearray(shard.read_bytes())
        data[-3] ^= 0x01
        shard.write_bytes(bytes(data))
    return _load_or_refusal(directory, parallel, model, optimizer)


def test_every_rank_refuses_a_shard_only_one_rank_reads(tmp_path):
    errors = run_distributed(_save_damage_load, world_size=2, args=(str(tmp_path / "step_1"),))
    assert errors[0] == errors[1], errors
    assert "model/tp01-pp00.safetensors does not match its recorded xxh3_128" in errors[0]


def _save_swap_load(rank: int, world_size: int, directory: str, folder: str = "model") -> str:
    parallel, model, optimizer, path = _saved(world_size, directory, stepped=True)
    if rank == 0:  # the two TP ranks' weight (or optimizer) files swapped, their checksums rewritten to match
        first, second = (path / folder / f"tp{t:02d}-pp00.safetensors" for t in range(2))
        held = first.read_bytes()
        first.write_bytes(second.read_bytes())
        second.write_bytes(held)
        for shard in (first, second):
            _rehash(path, f"{folder}/{shard.name}")
    return _load_or_refusal(directory, parallel, model, optimizer)


def test_a_tp_ranks_weights_file_swapped_with_anothers_is_refused(tmp_path):
    """Files of one tensor's TP shards have the same shape: swapped (or one copied over the other) they loaded
    without a word and trained on the wrong rows (5.5645 at step 3 where 5.3378 is right). Each weights file records
    the part it holds (``mtk_specs``), which must be the reading rank's; each optimizer file the place it was written
    for."""
    errors = run_distributed(_save_swap_load, world_size=2, args=(str(tmp_path / "step_1"),))
    for rank, (held, own) in enumerate((("[[130, 259]]", "[[0, 130]]"), ("[[0, 130]]", "[[130, 259]]"))):
        assert f"tp{rank:02d}-pp00.safetensors: model.embed_tokens.weight holds ranges {held}" in errors[rank], errors
        assert f"this rank holds ranges {own} of dim 0 of (259, 64): the file is another rank's" in errors[rank]
    errors = run_distributed(_save_swap_load, world_size=2, args=(str(tmp_path / "optimizer" / "step_1"), "optimizer"))
    for rank in range(2):  # their moments alike: step 4 5.227782 for 5.197235, nothing said
        written, own = f"tp{1 - rank:02d}-pp00", f"tp{rank:02d}-pp00"
        assert f"optimizer/{own}.safetensors was written as {written!r}, not {own!r}" in errors[rank], errors


def _replicas_differ(rank: int, world_size: int, directory: str, damage: str) -> str:
    parallel, model, optimizer, path = _saved(world_size, directory, stepped=True)
    if rank == 0:  # TP rank 1's file changed, its checksum rewritten with it
        _craft(path, damage)
    return _load_or_refusal(directory, parallel, model, optimizer)


def _craft(path, damage: str) -> None:
    """TP rank 1's copy of the final norm, its Adam moment or its steps changed, or its optimizer settings."""
    import json

    from safetensors.torch import load_file, save_file

    if damage == "settings":
        name = "optimizer/tp01-pp00.json"
        groups = json.loads((path / name).read_text())
        groups["param_groups"][0]["weight_decay"] = 0.5
        (path / name).write_text(json.dumps(groups))
    else:
        name = ("model" if damage == "weight" else "optimizer") + "/tp01-pp00.safetensors"
        tensors = load_file(str(path / name))
        if damage == "steps":  # every state's step of this rank: one step behind the other rank's
            tensors = {k: v - 1 if k.endswith("::step") else v for k, v in tensors.items()}
        else:
            key = "model.norm.weight" + ("::exp_avg" if damage == "moment" else "")
            tensors[key] = tensors[key] * 3
        save_file(tensors, str(path / name), metadata=_metadata(path / name))
    _rehash(path, name)


def _metadata(path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        return handle.metadata() or {}


def test_replicas_that_differ_between_the_tp_ranks_files_are_refused(tmp_path, capsys):
    """Every TP rank reads its own file; a norm (its optimizer state, its step count, or the rank's optimizer
    settings) that is not the same in each, its checksum rewritten to match, trained TP ranks with different replicas
    (still 2.0 apart after a step) with exit 0. Every rank refuses it, naming the tensor. Read at another layout
    (one process, TP 1), exported or verified, whichever TP rank's copy a reader would take is refused too: the
    files are not from one save."""
    from mtk.checkpoint.export import export_checkpoint
    from mtk.cli.main import main as mtk_main

    norm = "model.norm.weight"
    first = "model.layers.0.input_layernorm.weight::step"  # (every tensor of the rank: the first one is named)
    tensor = {"weight": norm, "moment": f"{norm}::exp_avg", "steps": first}
    for damage in ("weight", "moment", "steps", "settings"):
        directory = tmp_path / f"step_{damage}"
        errors = run_distributed(_replicas_differ, world_size=2, args=(str(directory), damage))
        if damage == "settings":  # read by rank 0 for every rank
            assert "the optimizer settings of TP rank 1's file differ from TP rank 0's" in errors[0], errors
            assert errors[1] == "rank 0 refused the checkpoint (its line says why)", errors
        else:
            assert errors[0] == errors[1], errors
            assert f"{tensor[damage]} differs between the TP ranks' files" in errors[0], errors[0]
        parallel = ParallelState.build()  # one process: the reshard path reads every TP rank's file
        model = parallelize(build_model("tiny-llama"), parallel)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        try:
            load_checkpoint(directory, parallel, model, [optimizer], [])
            said = "loaded"
        except CheckpointError as err:
            said = str(err)
        code, out = mtk_main(["verify-checkpoint", str(directory)]), capsys.readouterr()
        if damage == "settings":
            assert "the optimizer settings of TP rank 1's file differ from TP rank 0's" in said, said
            assert code == 2 and "optimizer settings of TP rank 1's file differ" in out.err, out.err
            continue  # (export reads weights only: the settings are not its concern)
        where = f"{tensor[damage]!r} differs between the files of TP ranks 0 and 1"
        assert where in said, said
        assert code == 2 and where in out.err, out.err
        if damage == "weight":
            try:
                export_checkpoint(directory, tmp_path / "export")
            except CheckpointError as err:
                assert where in str(err), err
            else:
                raise AssertionError("export took TP rank 0's copy of a norm the files disagree on")


def _rng_of_one_rank_crafted(rank: int, world_size: int, directory: str) -> str:
    parallel, model, optimizer, path = _saved(world_size, directory)
    if rank == 0:  # rank 1's RNG state replaced by a dict of another shape (its save label and checksum kept right)
        label = json.loads((path / "metadata.json").read_text())["save"]
        torch.save({"python": 1, "mtk_save": label}, path / "rng" / "rank00001.pt")
        _rehash(path, "rng/rank00001.pt")
    return _load_or_refusal(directory, parallel, model, optimizer)


def test_a_file_only_one_rank_reads_and_refuses_stops_every_rank(tmp_path):
    """Rank 1 refused its crafted RNG state in one line while rank 0 went on into training and failed in a
    collective ("a collective failed"). Now every rank stops at the load: rank 1 with its line, rank 0 naming it."""
    errors = run_distributed(_rng_of_one_rank_crafted, world_size=2, args=(str(tmp_path / "step_1"),))
    assert "rng/rank00001.pt does not hold what this run loads from it" in errors[1], errors
    assert errors[0] == "rank 1 refused the checkpoint (its line says why)", errors


def _save_at_one_split_load_at_another(rank: int, world_size: int, directory: str) -> float:
    """A 4-layer tiny-llama at PP 2 saved under the split 3,1 (its weights doubled) and loaded under 1,3: each rank's
    file has the name of its own but other layers in it; the largest difference from the doubled whole model."""
    from mtk.models import builtin_config

    config = builtin_config("tiny-llama")
    config.num_hidden_layers = 4
    parallel = ParallelState.build(pp_size=world_size)
    saved = parallelize(build_model(config, seed=0), parallel, pipeline_layers=(3, 1))
    with torch.no_grad():
        for param in saved.parameters():
            param.mul_(2)
    save_checkpoint(directory, parallel, saved, [], [], step=1)
    loaded = parallelize(build_model(config, seed=0), parallel, pipeline_layers=(1, 3))
    load_checkpoint(directory, parallel, loaded, [], [])
    whole = dict(build_model(config, seed=0).named_parameters())
    return max((param - 2 * whole[name]).abs().max().item() for name, param in loaded.named_parameters())


def test_a_checkpoint_resumes_under_another_split_of_the_layers(tmp_path):
    """docs/pipeline.md: a checkpoint written under one split resumes under another at the same pp (it was refused:
    "tp00-pp01.safetensors does not match the model"): the stage files are read as another layout."""
    assert run_distributed(_save_at_one_split_load_at_another, world_size=2, args=(str(tmp_path / "s"),)) == [0.0] * 2
