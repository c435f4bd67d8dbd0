"""Architectures converted by the plan transformers ships (``base_model_tp_plan``), no mtk code of their own.

A representative subset of ``mtk verify --all`` (the full sweep is a command: docs/architectures.md), one
architecture per style or quirk, each saved as an HF directory, loaded from it by mtk (only each rank's slices) and
exact vs transformers' ``from_pretrained`` of it in fp32 (logits, loss, every gradient):
plain colwise/rowwise (Cohere, Granite), gathered q/k/v before whole-projection q/k norms (FlexOlmo, GLM-4;
OLMo2 at TP=4, where its own plan's split norms cannot take replicated kv heads),
per-head norms ``replicated_with_grad_allreduce`` and a learnable activation between column and row
(Apertus), scaled embeddings and softcapping (Gemma 2/3), LayerNorm with biases (StarCoder2), partial
rotary (Phi), a fused per-head qkv and a head stored as ``embed_out`` (GPT-NeoX). TP=4 replicates the 2 kv heads.
"""

import pytest

from mtk.spawn import run_distributed
from mtk.verify.sweep import sweep_worker

SUBSET = [
    *("cohere", "granite", "flex_olmo", "glm4", "apertus"),
    *("gemma2", "gemma3_text", "starcoder2", "phi", "gpt_neox"),
]


@pytest.mark.parametrize("tp", [2, 4])
def test_hf_plans_are_exact(tp):
    types = SUBSET if tp == 2 else ["cohere", "olmo2", "gemma3_text"]
    rows = run_distributed(sweep_worker, world_size=tp, args=(types, 1e-5), timeout=600)[0]
    assert [(r.model_type, r.status, r.source) for r in rows] == [(t, "exact", "HF tp_plan") for t in types], [
        (r.model_type, r.status, r.reason) for r in rows if r.status != "exact"
    ]


def test_unsupported_styles_are_named():
    rows = run_distributed(sweep_worker, world_size=2, args=(["granite_swa", "minicpm3"], 1e-5))[0]
    assert [r.status for r in rows] == ["refused", "refused"]
    assert "local_params" in rows[0].reason and "mla_kv_a_proj" in rows[1].reason


MOE = ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "phimoe"]


def test_moe_experts_split_inside_are_exact():
    """Experts split like MLPs (gate/up halves by columns, down by rows), one all-reduce after them; router
    replicated; the load-balancing loss is part of the compared loss (output_router_logits)."""
    rows = run_distributed(sweep_worker, world_size=2, args=(MOE, 1e-5), timeout=600)[0]
    assert [(r.model_type, r.status) for r in rows] == [(t, "exact") for t in MOE], [
        (r.model_type, r.reason) for r in rows if r.status != "exact"
    ]


def _round_trip(rank: int, world_size: int, model_type: str) -> None:
    """The experts' shards gather back to HF's tensors bit for bit (checkpoints and export use the same specs)."""
    import copy

    import torch

    from mtk.convert import parallelize
    from mtk.models import build_model
    from mtk.parallel import ParallelState
    from mtk.parallel.gather import gather_state_dict
    from mtk.verify.sweep import tiny_config

    state = ParallelState.build(tp_size=world_size)
    reference = build_model(tiny_config(model_type), seed=0)
    full = gather_state_dict(parallelize(copy.deepcopy(reference), state), state)
    if rank == 0:
        expected = reference.state_dict()
        assert sorted(full) == sorted(expected)
        assert all(torch.equal(full[k], expected[k]) for k in expected)


def test_moe_state_dict_round_trip():
    run_distributed(_round_trip, world_size=2, args=("mixtral",))


@pytest.mark.parametrize("model_type", ["cohere", "gemma2", "mixtral"])
def test_hf_plan_pipelines_equal_single_process(model_type):
    """TP=2 x PP=2 through the stages HF's base_model_pp_plan names (embedding -> layers -> norm)."""
    from mtk.verify.sweep import tiny_config
    from tests.distributed.test_pipeline import _pipeline_checks

    config = tiny_config(model_type)
    config.output_router_logits = False  # the pipeline's last stage computes HF's causal-LM loss alone
    results = run_distributed(_pipeline_checks, world_size=4, args=(config, 2, 2, "1f1b", 2, ()))
    assert {r["stage"] for r in results} == {0, 1}


def test_sweep_runs_pipelines():
    """``mtk verify --all --pp 2``: stages from each base_model_pp_plan (GPT-NeoX: embedding dropout passes through
    after the first stage), loss and every gradient on the stage that owns it."""
    rows = run_distributed(sweep_worker, world_size=2, args=(["gpt_neox", "gemma2"], 1e-5, 2), timeout=600)[0]
    assert [(r.model_type, r.status) for r in rows] == [("gpt_neox", "exact"), ("gemma2", "exact")], [
        (r.model_type, r.reason) for r in rows
    ]


def _shared_input_checks(rank: int, world_size: int) -> dict:
    """Qwen3-MoE through its tp plan: attention's q/k/v take their input into the TP region once (the MoE block's
    input also feeds the router: not shared); sequence parallelism is one line; a shared input whose module feeds
    more than its columns fails the gradient parity check and the plan falls back to one copy per column."""
    import pytest

    import mtk.rules.from_tp_plan as from_tp_plan
    from mtk.convert import parallelize
    from mtk.models import build_model
    from mtk.parallel import ParallelState
    from mtk.rules.apply import CopyInputToTP
    from mtk.rules.base import SharedInput, UnsupportedModelError
    from mtk.rules.registry import resolve_rules

    state = ParallelState.build(tp_size=world_size)
    model = parallelize(build_model("tiny-qwen3-moe", seed=0), state)
    layer = model.model.layers[0]
    hooked = {
        name
        for name, module in layer.named_modules()
        if any(isinstance(h, CopyInputToTP) for h in module._forward_pre_hooks.values())
    }
    copying = {n for n in ("q_proj", "k_proj", "v_proj") if getattr(layer.self_attn, n).copy_input}
    with pytest.raises(UnsupportedModelError, match="not checked exact under it"):
        parallelize(build_model("tiny-qwen3-moe", seed=0), state, sequence_parallel=True)
    derived = from_tp_plan._shared_inputs
    # named with its argument, as hand-written rules are: past the check that a derived one's module holds only split
    # linears, so only the parity check's gradients can tell
    from_tp_plan._shared_inputs = lambda plan: (*derived(plan), SharedInput("**.layers.*.mlp"))
    try:
        fallback = resolve_rules(build_model("tiny-qwen3-moe", seed=0), state).shared_inputs
    finally:
        from_tp_plan._shared_inputs = derived
    return {"hooked": sorted(hooked), "copying": sorted(copying), "fallback": fallback}


def test_tp_plan_rules_share_the_input_of_sibling_columns():
    result = run_distributed(_shared_input_checks, world_size=2)[0]
    assert result == {"hooked": ["self_attn"], "copying": [], "fallback": ()}
