"""Phi-3: fused ``qkv_proj`` and ``gate_up_proj``.

Both fused projections are split per part (q, k, v each by heads; gate and up each by columns).
Phi-3's attention reads the head counts from its config in forward, so each attention module gets a
shallow config copy with the per-rank counts (the model's own config stays whole, for export).
"""

from mtk.rules.base import COLUMN, LM_HEAD, ROW, VOCAB, AttrFix, HeadCounts, Rule, RuleSet, SharedInput
from mtk.rules.llama import LLAMA_PIPELINE, llama_head_counts


def phi3_head_counts(config) -> HeadCounts:
    counts = llama_head_counts(config)
    return HeadCounts(counts.num_heads, counts.num_kv_heads, counts.head_dim, counts.intermediate_size, False)


def _qkv_parts(config) -> list[int]:
    counts = llama_head_counts(config)
    return [counts.num_heads * counts.head_dim] + [counts.num_kv_heads * counts.head_dim] * 2


PHI3 = RuleSet(
    name="phi3",
    model_types=("phi3",),
    rules=(
        Rule("**.layers.*.self_attn.qkv_proj", COLUMN, parts=_qkv_parts),
        Rule("**.layers.*.self_attn.o_proj", ROW),
        Rule("**.layers.*.mlp.gate_up_proj", COLUMN, parts=lambda config: [config.intermediate_size] * 2),
        Rule("**.layers.*.mlp.down_proj", ROW),
        Rule("**.embed_tokens", VOCAB),
        Rule("lm_head", LM_HEAD, optional=True),
    ),
    head_counts=phi3_head_counts,
    attr_fixes=(
        AttrFix("**.layers.*.self_attn", "config", lambda ctx: ctx.local_config()),
        AttrFix("**.layers.*.self_attn", "num_key_value_heads", lambda ctx: ctx.kv_local),
        AttrFix("**.layers.*.self_attn", "num_key_value_groups", lambda ctx: ctx.heads_local // ctx.kv_local),
    ),
    embedding="**.embed_tokens",
    pipeline=LLAMA_PIPELINE,
    shared_inputs=(SharedInput("**.layers.*.self_attn"), SharedInput("**.layers.*.mlp")),
    split_random=("**.layers.*.self_attn",),
    residual_dropouts=("**.layers.*.resid_attn_dropout", "**.layers.*.resid_mlp_dropout"),
)
