"""Loading a local HF directory at TP > 1 reads only this rank's slices, and gives HF's model."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import mtk.checkpoint.safetensors_slices as safetensors_slices
from mtk.checkpoint import CheckpointError, load_pretrained_tp
from mtk.checkpoint.safetensors_slices import SafetensorsFile
from mtk.models import build_model
from mtk.parallel import ParallelState
from mtk.testing import assert_close_rel, run_distributed


class _RecordingFile(SafetensorsFile):
    """The loader's file reader, keeping every slicer it hands out so bytes read can be summed."""

    slicers: list = []

    def get_slice(self, name):
        slicer = super().get_slice(name)
        _RecordingFile.slicers.append(slicer)
        return slicer


def _load_recording(directory: str, state: ParallelState):
    """``load_pretrained_tp`` with the reader swapped for :class:`_RecordingFile` (slicers reset)."""
    _RecordingFile.slicers = []
    original = safetensors_slices.SafetensorsFile  # what open_safetensors constructs
    safetensors_slices.SafetensorsFile = _RecordingFile  # type: ignore[misc]
    try:
        return load_pretrained_tp(directory, state)
    finally:
        safetensors_slices.SafetensorsFile = original  # type: ignore[misc]


def _load_and_compare(rank: int, world_size: int, directory: str) -> dict:
    state = ParallelState.build(tp_size=world_size)
    model = _load_recording(directory, state)
    read: dict[str, int] = {}
    for slicer in _RecordingFile.slicers:  # elements actually read from disk, per tensor
        read[slicer.name] = read.get(slicer.name, 0) + slicer.bytes_read // slicer.dtype.itemsize
    reference = AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close_rel(model(ids).logits, reference(ids).logits, "logits of the TP-loaded model")
    full = {name: p.numel() for name, p in reference.named_parameters()}
    return {"read": read, "full": full}


def test_tp_load_reads_only_this_ranks_slices(tmp_path):
    build_model("tiny-llama", seed=3).save_pretrained(tmp_path, max_shard_size="60KB")  # several shard files
    assert (tmp_path / "model.safetensors.index.json").exists()
    results = run_distributed(_load_and_compare, world_size=2, args=(str(tmp_path),))
    for result in results:
        read, full = result["read"], result["full"]
        assert set(read) == set(full), "every tensor read, no other"
        for key, numel in full.items():
            replicated = key.endswith("norm.weight")
            expected = numel if replicated else numel // 2
            if key in ("model.embed_tokens.weight", "lm_head.weight"):  # 259 rows: 130 + 129 real rows
                expected = None
                assert read[key] in (130 * 64, 129 * 64), key
            if expected is not None:
                assert read[key] == expected, key
        split = sum(n for k, n in full.items() if not k.endswith("norm.weight"))
        assert sum(read.values()) < 0.51 * split + sum(n for k, n in full.items() if k.endswith("norm.weight"))
    total_read = sum(sum(r["read"].values()) for r in results)
    assert math.isclose(
        total_read,
        sum(results[0]["full"].values()) + sum(n for k, n in results[0]["full"].items() if k.endswith("norm.weight")),
    )


def _load_error(rank: int, world_size: int, directory: str) -> str:
    state = ParallelState.build(tp_size=world_size)
    try:
        load_pretrained_tp(directory, state)
    except (CheckpointError, ValueError) as err:
        return str(err)
    return "loaded"


def test_bad_directories_get_clear_errors(tmp_path):
    good = tmp_path / "good"
    build_model("tiny-llama").save_pretrained(good, max_shard_size="60KB")
    corrupt = tmp_path / "corrupt"
    build_model("tiny-llama").save_pretrained(corrupt, max_shard_size="60KB")
    victim = sorted(corrupt.glob("model-*.safetensors"))[0]
    victim.write_bytes(victim.read_bytes()[:100])  # truncated mid-header
    pickled = tmp_path / "pickled"  # an old-style directory: config.json + pytorch_model.bin only
    pickled_model = build_model("tiny-llama")
    pickled_model.config.save_pretrained(pickled)
    torch.save(pickled_model.state_dict(), pickled / "pytorch_model.bin")
    missing_shard = tmp_path / "missing"
    build_model("tiny-llama").save_pretrained(missing_shard, max_shard_size="60KB")
    lost = sorted(missing_shard.glob("model-*.safetensors"))[-1]
    lost.unlink()

    cases = {
        str(tmp_path / "nowhere"): "does not exist",
        str(corrupt): f"{victim.name} is not a readable safetensors file",
        str(pickled): "mtk loads safetensors only",
        str(missing_shard): f"{lost.name} is listed in model.safetensors.index.json but does not exist",
    }
    messages = run_distributed(_load_error_many, world_size=2, args=(list(cases),))[0]
    for (directory, expected), message in zip(cases.items(), messages):
        assert expected in message, (directory, message)
        assert "\n" not in message
    assert run_distributed(_load_error, world_size=1, args=(str(good),)) == ["loaded"]


def _load_error_many(rank: int, world_size: int, directories: list[str]) -> list[str]:
    return [_load_error(rank, world_size, d) for d in directories]


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-gpt2", "tiny-qwen3"])
def test_tied_and_conv1d_checkpoints_load(tmp_path, name):
    build_model(name, seed=4).save_pretrained(tmp_path)
    run_distributed(_load_and_compare, world_size=2, args=(str(tmp_path),))


def test_loaded_tp_shared_norms_get_exact_gradients(tmp_path):
    """Qwen3's per-head q/k norms read from an HF dir: the loader's new parameters sum grads over TP."""
    from mtk.verify import verify_worker

    build_model("tiny-qwen3", seed=4).save_pretrained(tmp_path)
    for result in run_distributed(verify_worker, world_size=2, args=(str(tmp_path), "fp32", 2, 16, 0)):
        assert not result.error and result.grads <= 1e-5, (result.grads, result.worst_param, result.error)
        assert result.num_params > 0


def test_verify_of_an_encoder_saved_without_its_classification_head(tmp_path):
    """A BERT saved as ``BertModel`` (all-MiniLM-L6-v2; classify.py starts its head fresh) was refused by verify
    (no tensor for 'classifier.weight'): the head starts from the seed on both sides, on every rank alike."""
    from transformers import BertModel

    from mtk.verify import verify_worker

    BertModel(build_model("tiny-bert", seed=2).config).save_pretrained(tmp_path)
    for result in run_distributed(verify_worker, world_size=2, args=(str(tmp_path), "fp32", 2, 16, 0)):
        assert not result.error and result.model_class == "BertForSequenceClassification", result.error
        assert max(result.logits, result.loss, result.grads) <= 1e-5, (result.grads, result.worst_param)


def _load_stage(rank: int, world_size: int, directory: str, tp: int) -> dict:
    from mtk.pipeline.engine import PipelineModel

    state = ParallelState.build(tp_size=tp, pp_size=world_size // tp)
    model = _load_recording(directory, state)
    read = {s.name for s in _RecordingFile.slicers if s.bytes_read}
    reference = AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = torch.randint(0, 256, (4, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = PipelineModel(model, state, num_micro_batches=2)(input_ids=ids, labels=ids).loss
        assert_close_rel(loss, reference(input_ids=ids, labels=ids).loss, "loss of the PP-loaded model")
    return {"stage": state.pp_rank, "read": sorted(read), "params": sorted(n for n, _ in model.named_parameters())}


def test_pp_load_reads_only_this_stages_tensors(tmp_path, tp=2):
    """Tied GPT-2 at TP=2 x PP=2: stage 0 reads the embeddings and block 0, stage 1 block 1, the final
    norm and the tied head (stored once, as the embedding)."""
    build_model("tiny-gpt2", seed=3).save_pretrained(tmp_path)
    for result in run_distributed(_load_stage, world_size=2 * tp, args=(str(tmp_path), tp)):
        blocks = {name.split(".")[2] for name in result["read"] if name.startswith("transformer.h.")}
        if result["stage"] == 0:
            assert blocks == {"0"} and "transformer.wpe.weight" in result["read"]
            assert "transformer.ln_f.weight" not in result["read"]
        else:
            assert blocks == {"1"} and "transformer.ln_f.weight" in result["read"]
            assert "transformer.wpe.weight" not in result["read"]
            assert "lm_head.weight" in result["params"], "the last stage's copy of the tied embedding"
        assert "transformer.wte.weight" in result["read"], "both ends read the tied embedding"


def _load_buffers_and_report(rank: int, world_size: int, directory: str, pp: int) -> dict:
    import contextlib
    import io

    state = ParallelState.build(tp_size=world_size // pp, pp_size=pp)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        model = load_pretrained_tp(directory, state)
    reference = AutoModelForCausalLM.from_pretrained(directory)
    buffers = {n: b for n, b in model.named_buffers() if "e_score_correction_bias" in n}
    for name, buffer in buffers.items():
        assert torch.equal(buffer, reference.get_buffer(name)), name
    return {"buffers": len(buffers), "printed": printed.getvalue()}


@pytest.mark.parametrize("pp", [1, 2])
def test_persistent_buffers_load_and_tensors_nothing_uses_are_named(tmp_path, pp):
    """GLM-4-MoE's router keeps a trained ``e_score_correction_bias`` as a persistent buffer: it is read as
    ``from_pretrained`` reads it (mtk kept the initial zeros, routing otherwise than the checkpoint, without a word).
    Tensors the model has no parameter or buffer for (a stray head, an extra projection) are not read and are named
    in one line by rank 0; under a pipeline only what no stage reads is named."""
    from safetensors.torch import load_file, save_file

    from mtk.verify.sweep import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("glm4_moe"))
    for name, buffer in model.named_buffers():
        if "e_score_correction_bias" in name:
            buffer.copy_(torch.randn_like(buffer))
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    tensors["stray_head.weight"] = torch.zeros(2, 2)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    results = run_distributed(_load_buffers_and_report, world_size=2, args=(str(tmp_path), pp))
    assert sum(r["buffers"] for r in results) > 0
    line = "2 tensor(s) no parameter of the model uses, not loaded: model.layers.0.mlp.extra_proj.weight, stray_head"
    assert line in results[0]["printed"] and results[0]["printed"].count("\n") == 1, results[0]["printed"]
    assert not results[1]["printed"]


def _load_at_ep(rank: int, world_size: int, directory: str) -> dict:
    state = ParallelState.build(tp_size=1, ep_size=world_size)
    model = _load_recording(directory, state)
    read_experts = sum(s.bytes_read // s.dtype.itemsize for s in _RecordingFile.slicers if ".experts." in s.name)
    reference = AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # every rank the same rows: the all-to-alls bring each token to its experts' rank
        assert_close_rel(model(ids).logits, reference(ids).logits, "logits of the EP-loaded model")
    held = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    whole = sum(p.numel() for n, p in reference.named_parameters() if ".experts." in n)
    return {"read": read_experts, "held": held, "whole": whole}


def test_ep_load_reads_only_this_ranks_experts(tmp_path):
    """``--model <dir>`` at EP 2: each rank reads its own experts' rows (of the per-expert tensors transformers
    writes, or of merged ones) and nothing of the other rank's, then runs HF's model exactly."""
    build_model("tiny-qwen3-moe", seed=3).save_pretrained(tmp_path)
    for result in run_distributed(_load_at_ep, world_size=2, args=(str(tmp_path),)):
        assert result["read"] == result["held"] == result["whole"] // 2, result
