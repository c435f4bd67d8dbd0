"""LoRA on the tensor-parallel model equals PEFT's LoRA on the single-process HF model.

Each rank builds the HF model, makes a copy parallel, adds adapters with ``mtk.lora.get_peft_model`` and
gives PEFT's own single-process ``get_peft_model`` the same (gathered) adapters. Loss, logits and every
adapter gradient agree in fp32 (relative error <= 1e-5); the frozen base gets no gradient; the forward
runs exactly the base model's collectives (the adapters ride on them).
"""

import copy
import json

import pytest
import torch
from peft import LoraConfig
from peft import get_peft_model as peft_get_peft_model

from mtk.convert import parallelize
from mtk.lora import get_peft_model
from mtk.models import build_model
from mtk.parallel import ParallelState
from mtk.parallel.collective_count import count_collectives
from mtk.parallel.gather import full_shape_and_spec, gather_full_tensor, gather_state_dict
from mtk.parallel.grad_norm import grad_norm_tp
from mtk.testing import assert_close_rel, run_distributed
from tests.distributed.test_architectures import ARCHITECTURES, _inputs

# TP=2 for every family; TP=4 where the adapters take another path: B per kv head when kv heads are
# replicated (Llama, Qwen3), per part when the projection is fused (Phi-3, GPT-2); sequence parallelism.
CASES = (
    [(name, 2, False) for name in ARCHITECTURES]
    + [(name, 4, False) for name in ("tiny-llama", "tiny-qwen3", "tiny-phi3", "tiny-gpt2")]
    + [(name, 2, True) for name in ("tiny-llama", "tiny-gpt2", "tiny-phi3")]
)


def _config(targets, **kwargs) -> LoraConfig:
    # init_lora_weights=False: B starts non-zero, so A's gradient is non-zero at the first step too
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **kwargs)


def reference_for(hf_model, peft_model, parallel: ParallelState):
    """PEFT's single-process LoRA model with the parallel model's adapters (gathered, sent to every rank)."""
    full = gather_state_dict(peft_model, parallel)
    shared = [{k: v for k, v in full.items() if "lora_" in k}]
    torch.distributed.broadcast_object_list(shared, src=0)
    reference = peft_get_peft_model(hf_model, copy.deepcopy(peft_model.peft_config["default"]))  # targets resolved
    result = reference.load_state_dict(shared[0], strict=False)
    assert not result.unexpected_keys and not [k for k in result.missing_keys if "lora_" in k]
    return reference


def full_grads(model, parallel: ParallelState) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            shape, spec = full_shape_and_spec(model, name)
            grads[name] = gather_full_tensor(param.grad, spec, shape, parallel.tp_group)
        else:
            assert param.grad is None, f"frozen {name} got a gradient"
    return grads


def _lora_checks(
    rank: int, world_size: int, name: str, targets, sequence_parallel: bool, task_type: str | None = None
) -> dict:
    state = ParallelState.build(tp_size=world_size)
    hf = build_model(name, seed=0).eval()  # no dropout: the masks of two layouts differ
    plain = parallelize(copy.deepcopy(hf), state, sequence_parallel=sequence_parallel)
    config = _config(targets, **({"task_type": task_type} if task_type else {}))
    model = get_peft_model(parallelize(copy.deepcopy(hf), state, sequence_parallel=sequence_parallel), config)
    reference = reference_for(hf, model, state)
    batch = _inputs(name)
    expected = reference(**batch)
    expected.loss.backward()
    with count_collectives() as log:
        plain(**batch)
    base_forward = dict(log.counts())
    with count_collectives() as log:
        out = model(**batch)
    forward = dict(log.counts())
    out.loss.backward()
    if sequence_parallel:
        from mtk.parallel.grads import sync_sequence_parallel_grads

        sync_sequence_parallel_grads(model, state.tp_group)
    assert_close_rel(out.loss, expected.loss, f"{name} loss")
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    assert_close_rel(logits, expected.logits, f"{name} logits")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        with model.disable_adapter():  # PEFT's switches work on the parallel layers: the base alone ...
            assert_close_rel(model(**inputs).logits, plain(**inputs).logits, f"{name} adapters disabled")
        model.merge_adapter()  # ... and merged into each rank's shard (B_r A or B A_r: local)
        assert_close_rel(model(**inputs).logits, expected.logits, f"{name} merged logits")
        model.unmerge_adapter()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    grads = full_grads(model, state)
    assert sorted(grads) == sorted(ref_grads)
    for param_name, grad in grads.items():
        assert_close_rel(grad, ref_grads[param_name], f"{name} grad of {param_name}")
    norm = grad_norm_tp([p for p in model.parameters() if p.requires_grad], state)  # split factors counted once
    assert_close_rel(norm, torch.nn.utils.get_total_norm(list(ref_grads.values())), f"{name} gradient norm")
    return {"forward": forward, "base_forward": base_forward, "adapted": len(grads), "trained": sorted(grads)}


@pytest.mark.parametrize("name,tp,sequence_parallel", CASES)
def test_lora_equals_peft(name, tp, sequence_parallel):
    result = run_distributed(_lora_checks, world_size=tp, args=(name, "all-linear", sequence_parallel))[0]
    assert result["forward"] == result["base_forward"]  # no collective of its own in forward
    assert result["adapted"] > 0


def test_lora_keeps_a_bert_classifier_trainable():
    """SEQ_CLS: PEFT's modules_to_save trains a copy of the (replicated) classifier next to the adapters."""
    result = run_distributed(_lora_checks, world_size=2, args=("tiny-bert", "all-linear", False, "SEQ_CLS"))[0]
    assert any("classifier.modules_to_save" in name for name in result["trained"])


def _batch(rows: int = 4, seq: int = 8) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (rows, seq), generator=torch.Generator().manual_seed(1))
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)


def _layout_checks(rank: int, world_size: int, tp: int, pp: int, virtual: int = 1) -> int:
    """TP x PP through the pipeline engine (interleaved with ``virtual`` > 1 chunks per rank), or TP x DP
    through DDP: the adapters' gradients equal PEFT's."""
    from mtk.models import builtin_config
    from mtk.pipeline.engine import PipelineModel

    state = ParallelState.build(tp_size=tp, pp_size=pp)
    config = builtin_config("tiny-llama")
    config.num_hidden_layers = 2 * virtual
    hf = build_model(config, seed=0).eval()
    cut = parallelize(copy.deepcopy(hf), state, virtual_stages=virtual)
    model = get_peft_model(cut, _config(["q_proj", "v_proj", "o_proj", "down_proj"]))
    reference = reference_for(hf, model, state)
    batch = _batch()
    expected = reference(**batch)
    expected.loss.backward()
    share = len(batch["input_ids"]) // state.dp_size
    local = {k: v[state.dp_rank * share : (state.dp_rank + 1) * share] for k, v in batch.items()}
    if pp > 1:
        pipe = PipelineModel(model, state, num_micro_batches=2, schedule="interleaved" if virtual > 1 else "1f1b")
        loss = pipe(**local).loss
        pipe.finalize_grads()
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=state.dp_group)
        loss = ddp(**local).loss
        loss.backward()
        loss = loss.detach().clone()
        torch.distributed.all_reduce(loss, group=state.dp_group)
        loss /= state.dp_size
    assert_close_rel(loss, expected.loss, "loss")
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    grads = full_grads(model, state)
    for name, grad in grads.items():
        assert_close_rel(grad, ref_grads[name], f"grad of {name}")
    return len(grads)


@pytest.mark.parametrize("tp,pp,dp,virtual", [(2, 2, 1, 1), (2, 1, 2, 1), (2, 2, 1, 2)])
def test_lora_pipeline_and_data_parallel_equal_peft(tp, pp, dp, virtual):
    counts = run_distributed(_layout_checks, world_size=tp * pp * dp, args=(tp, pp, virtual))
    assert all(count > 0 for count in counts)
    if pp > 1:  # each stage holds (and compares) only its own layers' adapters
        assert counts[0] < 2 * virtual * 4 * 2  # 2v layers x 4 targets x (A, B) in the whole model


def _train_and_save(rank: int, world_size: int, root: str) -> dict:
    """One step at TP=2, saved (adapters only); a resume on another base is one clear line."""
    from pathlib import Path

    from safetensors import safe_open

    from mtk.checkpoint.sharded import load_checkpoint, save_checkpoint
    from mtk.errors import CheckpointError

    root_path = Path(root)
    state = ParallelState.build(tp_size=world_size)
    hf = build_model("tiny-llama", seed=0).eval()
    if rank == 0:
        hf.save_pretrained(root_path / "base")
    model = get_peft_model(parallelize(copy.deepcopy(hf), state), _config("all-linear"), report=lambda line: None)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = _batch()
    model(**batch).loss.backward()
    optimizer.step()
    ckpt = save_checkpoint(root_path / "step_1", state, model, [optimizer], [], step=1)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    with safe_open(str(ckpt / "model" / f"tp{rank:02d}-pp00.safetensors"), "pt") as f:
        stored = list(f.keys())
    assert stored and all(".lora_" in key for key in stored), "only the adapters are stored"
    other = get_peft_model(
        parallelize(build_model("tiny-llama", seed=1), state), _config("all-linear"), report=lambda line: None
    )
    try:  # another base: one clear line, nothing loaded
        load_checkpoint(ckpt, state, other, [], [])
        raise AssertionError("a checkpoint was resumed on another base")
    except CheckpointError as err:
        assert "trained on the base" in str(err)
    if rank == 0:
        build_model("tiny-llama", seed=1).save_pretrained(root_path / "other_base")
    return {"stored": len(stored), "logits": logits}


def test_adapter_checkpoint_export_reproduces_logits(tmp_path):
    """``export --adapter`` loads with PeftModel.from_pretrained, ``--merge`` with from_pretrained: both give the
    trained TP=2 model's logits; merging into another base is refused and leaves nothing behind."""
    from peft import PeftModel

    from mtk.checkpoint.adapter_export import export_adapter, export_merged
    from mtk.errors import CheckpointError, MtkError

    results = run_distributed(_train_and_save, world_size=2, args=(str(tmp_path),))
    assert results[0]["stored"] == 2 * 7 * 2  # 2 layers x 7 linears x (A, B)
    logits, ids = results[0]["logits"], _batch()["input_ids"]
    export_adapter(tmp_path / "step_1", tmp_path / "adapter")
    base = build_model("tiny-llama", seed=0).eval()
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(input_ids=ids).logits
    assert_close_rel(logits, peft_logits, "PeftModel.from_pretrained logits")
    export_merged(tmp_path / "step_1", tmp_path / "merged", base=tmp_path / "base")
    merged = type(base.get_base_model() if hasattr(base, "get_base_model") else base)
    with torch.no_grad():
        merged_logits = merged.from_pretrained(tmp_path / "merged").eval()(input_ids=ids).logits
    assert_close_rel(logits, merged_logits, "merged model logits")
    with pytest.raises(CheckpointError, match="not the base"):
        export_merged(tmp_path / "step_1", tmp_path / "merged_other", base=tmp_path / "other_base")
    assert not list(tmp_path.glob("merged_other*"))
    # a base whose index maps its tensors outside it, or with pickled weights only: a model directory's own checks
    outside, pickled = tmp_path / "outside_base", tmp_path / "pickled_base"
    for directory in (outside, pickled):
        directory.mkdir()
        for name in ("config.json",):
            (directory / name).write_bytes((tmp_path / "base" / name).read_bytes())
    (outside / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "../base/model.safetensors"}})
    )
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    for directory, message in ((outside, "not a file beside it"), (pickled, "only as pickles")):
        with pytest.raises(MtkError, match=message):
            export_merged(tmp_path / "step_1", tmp_path / "merged_bad", base=directory)
    assert not list(tmp_path.glob("merged_bad*"))


def _dropout_checks(rank: int, world_size: int) -> None:
    """LoRA dropout on column-parallel layers draws the single process's masks (the default stream: their input
    is the same on every TP rank), so with dropout on, TP=2 still equals PEFT on one process."""
    state = ParallelState.build(tp_size=world_size)
    hf = build_model("tiny-llama", seed=0)  # train mode; Llama itself has no dropout
    targets = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
    model = get_peft_model(parallelize(copy.deepcopy(hf), state), _config(targets, lora_dropout=0.5))
    reference = reference_for(hf, model, state)
    batch = _batch()
    torch.manual_seed(5)
    expected = reference(**batch)
    expected.loss.backward()
    torch.manual_seed(5)
    out = model(**batch)
    out.loss.backward()
    assert_close_rel(out.loss, expected.loss, "loss with LoRA dropout")
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    for name, grad in full_grads(model, state).items():
        assert_close_rel(grad, ref_grads[name], f"grad of {name} with LoRA dropout")


def test_lora_dropout_on_columns_equals_peft():
    run_distributed(_dropout_checks, world_size=2)


def _base_dtype_checks(rank: int, world_size: int) -> dict:
    """A bf16 base keeps fp32 adapters (PEFT's autocast): the optimizer state is fp32, the base stays bf16."""
    state = ParallelState.build(tp_size=world_size)
    hf = build_model("tiny-llama", seed=0, dtype=torch.bfloat16).eval()
    model = get_peft_model(parallelize(copy.deepcopy(hf), state), _config("all-linear"), report=lambda line: None)
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    reference = reference_for(hf, model, state)
    batch = _batch()
    expected = reference(**batch).loss
    loss = model(**batch).loss
    loss.backward()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    optimizer.step()
    moments = {s["exp_avg"].dtype for s in optimizer.state.values()}
    assert_close_rel(loss.float(), expected.float(), "bf16 base loss", tol=2e-2)  # bf16 sums differ by layout
    return {"adapters": dtypes, "base": frozen, "moments": moments}


def test_bf16_base_keeps_fp32_adapters():
    result = run_distributed(_base_dtype_checks, world_size=2)[0]
    assert result == {"adapters": {torch.float32}, "base": {torch.bfloat16}, "moments": {torch.float32}}


def _bad_target_messages(rank: int, world_size: int) -> list[str]:
    from mtk.errors import ConfigError

    state = ParallelState.build(tp_size=world_size)
    messages = []
    for name, targets, *case in [
        ("tiny-bert", ["classifier"]),  # a linear mtk keeps whole
        ("tiny-llama", ["self_attn"]),  # not a linear
        ("tiny-llama", ["q_proj", "qproj"]),  # a typo
        ("tiny-llama", ["lm_head"]),  # the vocabulary-parallel head
        ("tiny-llama", ["q_proj"], ["lm_head"]),  # a split module PEFT would copy whole
        ("tiny-qwen3-moe", ["q_proj"], None, ["mlp.experts.gate_up_proj"]),  # PEFT's LoRA on TP-split experts: runs
        ("tiny-qwen3-moe", None, ["lm_head"], ["mlp.gate.weight"]),  # parameter targets only, a split module saved
        ("tiny-qwen3-moe", ["q_proj"], None, ["mlp.experts.gate_proj"]),  # a parameter the model does not have
    ]:
        try:
            extra = {"modules_to_save": case[0]} if case and case[0] else {}
            if len(case) > 1:
                extra["target_parameters"] = case[1]
            get_peft_model(parallelize(build_model(name, seed=0), state), _config(targets, **extra))
            messages.append("accepted")
        except ConfigError as err:
            messages.append(str(err))
    for targets, extra in [
        (r".*\.(q_proj|v_proj)", {}),  # PEFT's regular expression (an re.Match, not True): the same as the list
        (["q_proj"], {"layer_replication": [[0, 1], [0, 1]]}),  # PEFT copies layers sharing their base weights
    ]:
        try:
            get_peft_model(parallelize(build_model("tiny-llama", seed=0), state), _config(targets, **extra))
            messages.append("accepted")
        except ConfigError as err:
            messages.append(str(err))
    return messages


def test_bad_targets_are_one_line_each():
    messages = run_distributed(_bad_target_messages, world_size=2)[0]
    assert "classifier is a Linear mtk keeps whole" in messages[0] and "modules_to_save" in messages[0]
    assert "self_attn is a LlamaAttention, not a linear layer" in messages[1]
    assert "qproj match no module" in messages[2] and "q_proj" in messages[2]
    assert "vocabulary-parallel output head" in messages[3]
    assert "modules_to_save lm_head: lm_head is a tensor-parallel VocabParallelHead" in messages[4]
    assert messages[5] == "accepted"  # whole factors, each rank its slice (tests/distributed/test_expert_parallel.py)
    assert "modules_to_save lm_head: lm_head is a tensor-parallel" in messages[6], messages[6]
    assert "target_parameters mlp.experts.gate_proj match no parameter" in messages[7], messages[7]
    assert messages[8] == "accepted", messages[8]
    assert "LoRA layer_replication is not supported by mtk" in messages[9], messages[9]
    assert all("\n" not in m for m in messages)


def _peft_start_checks(rank: int, world_size: int, tp: int, pp: int) -> int:
    """Adapters replayed as PEFT draws them on one process and cut to the shards (at TP, and on the stages of a
    pipeline, whose draws follow the earlier stages'): gathered, they equal PEFT's own, bit for bit."""
    from mtk.lora import load_full_adapters, peft_initial_adapters

    state = ParallelState.build(tp_size=tp, pp_size=pp)
    targets = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    compared = 0
    for init, dtype, extra in [
        (True, torch.float32, {}),
        (False, torch.float32, {"rank_pattern": {"v_proj": 2}}),
        ("gaussian", torch.bfloat16, {}),  # rounded to the base's dtype, then kept in fp32 (autocast)
    ]:
        hf = build_model("tiny-llama", seed=0, dtype=dtype).eval()
        config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=init, **extra)
        model = get_peft_model(parallelize(copy.deepcopy(hf), state), config)
        loaded = load_full_adapters(model, peft_initial_adapters(model, config, seed=3))
        torch.manual_seed(3)
        reference = dict(peft_get_peft_model(copy.deepcopy(hf), copy.deepcopy(config)).named_parameters())
        for name, param in model.named_parameters():
            if ".lora_" in name:
                shape, spec = full_shape_and_spec(model, name)
                full = gather_full_tensor(param, spec, shape, state.tp_group)
                assert full.dtype == reference[name].dtype and torch.equal(full, reference[name]), (init, name)
                compared += 1
        assert compared and loaded == sum(".lora_" in name for name, _ in model.named_parameters())
    return compared


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_adapters_can_start_where_peft_starts_on_one_process(tp, pp):
    counts = run_distributed(_peft_start_checks, world_size=tp * pp, args=(tp, pp))
    assert all(count > 0 for count in counts)


def _hybrid_stage_save(rank: int, world_size: int, root: str) -> list[str]:
    """Qwen3-Next at PP 2: stage 0 holds three linear-attention layers, stage 1 the full-attention one, so the
    stages hold different linears. ``all-linear`` was each stage's own, and the main process's (without q/k/v/o)
    became the saved adapter config: PEFT loaded the saved full-attention adapters of stage 1 as nothing."""
    from peft import PeftModel

    from mtk.verify.sweep import tiny_config

    state = ParallelState.build(tp_size=1, pp_size=world_size)
    config = tiny_config("qwen3_next")
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    hf = build_model(config, seed=0).eval()
    cut = parallelize(copy.deepcopy(hf), state, pipeline_layers=(3, 1))
    model = get_peft_model(cut, _config("all-linear"), report=lambda line: None)
    full = gather_state_dict(model, state)
    model.save_pretrained(root, state_dict=full)
    targets = sorted(model.peft_config["default"].target_modules)
    if rank == 0:
        loaded = dict(PeftModel.from_pretrained(hf, root).named_parameters())
        saved = {k: v for k, v in full.items() if ".lora_" in k}
        assert any(".self_attn.q_proj." in k for k in saved)
        for name, tensor in saved.items():
            assert torch.equal(loaded[name], tensor), name
    return targets


def test_all_linear_names_every_stages_linears_and_the_saved_adapters_load(tmp_path):
    targets = run_distributed(_hybrid_stage_save, world_size=2, args=(str(tmp_path),))
    assert targets[0] == targets[1] and {"q_proj", "in_proj_qkvz"} <= set(targets[0]), targets


def _tied_stage_state(rank: int, world_size: int) -> list[str]:
    state = ParallelState.build(tp_size=1, pp_size=world_size)
    cut = parallelize(build_model("tiny-gpt2", seed=0), state)
    model = get_peft_model(cut, _config("all-linear"), report=lambda line: None)
    full = gather_state_dict(model, state)
    if rank == 0:
        head, embedding = "base_model.model.lm_head.weight", "base_model.model.transformer.wte.weight"
        assert full[head] is full[embedding]
    return sorted(full)


def test_a_tied_models_adapters_at_pp_gather_with_the_head():
    """GPT-2 at PP 2 with LoRA: the last stage's copy of the tied embedding named its HF name
    (``transformer.wte.weight``), which the PeftModel's state holds under ``base_model.model.``: a KeyError at
    every save_model, after the run had trained."""
    keys = run_distributed(_tied_stage_state, world_size=2)[0]
    assert any(".lora_A." in key for key in keys)
