"""Llama family: Llama, Mistral, Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms).

Attention is split by heads: q by query heads, k/v by kv heads (or one kv head per rank when tp
exceeds them), o_proj by rows. SwiGLU: gate/up by columns, down by rows. HF's attention derives the
local head count from the projection's width (``view(..., -1, head_dim)``); only the GQA ratio
``num_key_value_groups`` needs a per-rank value.
"""

from mtk.rules.base import (
    COLUMN,
    IDENTITY,
    KV_COLUMN,
    LM_HEAD,
    REMOVE,
    ROW,
    TP_SHARED,
    VOCAB,
    AttrFix,
    HeadCounts,
    PipelineSpec,
    Rule,
    RuleSet,
    SharedInput,
)


def llama_head_counts(config) -> HeadCounts:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return HeadCounts(heads, kv_heads, head_dim, config.intermediate_size)


# Stages: the first embeds, the last runs the final norm and the head; HF's forward does the rest
# (positions, rotary embeddings, masks) on every stage.
LLAMA_PIPELINE = PipelineSpec(
    layers="**.layers",
    first_stage=(("**.embed_tokens", REMOVE),),
    last_stage=(("**.norm", IDENTITY), ("lm_head", REMOVE)),
)

LLAMA = RuleSet(
    name="llama",
    model_types=("llama", "mistral", "qwen2", "qwen3"),
    rules=(
        Rule("**.layers.*.self_attn.q_proj", COLUMN),
        Rule("**.layers.*.self_attn.k_proj", KV_COLUMN),
        Rule("**.layers.*.self_attn.v_proj", KV_COLUMN),
        Rule("**.layers.*.self_attn.o_proj", ROW),
        Rule("**.layers.*.self_attn.q_norm", TP_SHARED, optional=True),
        Rule("**.layers.*.self_attn.k_norm", TP_SHARED, optional=True),
        Rule("**.layers.*.mlp.gate_proj", COLUMN),
        Rule("**.layers.*.mlp.up_proj", COLUMN),
        Rule("**.layers.*.mlp.down_proj", ROW),
        Rule("**.embed_tokens", VOCAB),
        Rule("lm_head", LM_HEAD, optional=True),
    ),
    head_counts=llama_head_counts,
    attr_fixes=(
        AttrFix("**.layers.*.self_attn", "num_key_value_groups", lambda ctx: ctx.heads_local // ctx.kv_local),
    ),
    embedding="**.embed_tokens",
    pipeline=LLAMA_PIPELINE,
    shared_inputs=(SharedInput("**.layers.*.self_attn"), SharedInput("**.layers.*.mlp")),
    split_random=("**.layers.*.self_attn",),  # attention dropout on this rank's heads
)
