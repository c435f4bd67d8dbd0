"""Architectures converted by the plan transformers ships (``base_model_tp_plan``), no mtk code of their own.

A representative subset of ``mtk verify --all`` (the full sweep is a command: docs/architectures.md), one
architecture per style or quirk, each exact vs the unconverted model in fp32 (logits, loss, every gradient):
plain colwise/rowwise (Cohere, Granite), gathered q/k/v before whole-projection q/k norms (OLMo2, GLM-4),
per-head norms ``replicated_with_grad_allreduce`` and a learnable activation between column and row
(Apertus), scaled embeddings and softcapping (Gemma 2/3), LayerNorm with biases (StarCoder2), partial
rotary (Phi), a fused per-head qkv (GPT-NeoX). TP=4 replicates the 2 kv heads.
"""

import pytest

from mtk.spawn import run_distributed
from mtk.sweep import sweep_worker

SUBSET = ["cohere", "granite", "olmo2", "glm4", "apertus", "gemma2", "gemma3_text", "starcoder2", "phi", "gpt_neox"]


@pytest.mark.parametrize("tp", [2, 4])
def test_hf_plans_are_exact(tp):
    types = SUBSET if tp == 2 else ["cohere", "olmo2", "gemma3_text"]
    rows = run_distributed(sweep_worker, world_size=tp, args=(types, 1e-5), timeout=600)[0]
    assert [(r.model_type, r.status, r.source) for r in rows] == [(t, "exact", "HF plan") for t in types], [
        (r.model_type, r.status, r.reason) for r in rows if r.status != "exact"
    ]


def test_unsupported_styles_are_named():
    rows = run_distributed(sweep_worker, world_size=2, args=(["mixtral", "minicpm3"], 1e-5))[0]
    assert [r.status for r in rows] == ["refused", "refused"]
    assert "moe_tp_experts" in rows[0].reason and "mla_kv_a_proj" in rows[1].reason
