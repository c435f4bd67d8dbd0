"""Fallback for decoder architectures no family file names, by the module names most HF decoders use.

It is never trusted blindly: :func:`mtk.convert.parallelize` first converts a one-layer random
copy of the model with it and compares logits with the unconverted copy; only on a match is it used.
"""

from mtk.rules.base import COLUMN, KV_COLUMN, LM_HEAD, ROW, VOCAB, AttrFix, Rule, RuleSet
from mtk.rules.llama import llama_head_counts

GENERIC = RuleSet(
    name="generic (q_proj/k_proj/v_proj/o_proj, gate_proj/up_proj/down_proj)",
    model_types=(),
    rules=(
        Rule("**.q_proj", COLUMN),
        Rule("**.k_proj", KV_COLUMN),
        Rule("**.v_proj", KV_COLUMN),
        Rule("**.o_proj", ROW),
        Rule("**.gate_proj", COLUMN),
        Rule("**.up_proj", COLUMN),
        Rule("**.down_proj", ROW),
        Rule("**.embed_tokens", VOCAB, optional=True),
        Rule("lm_head", LM_HEAD, optional=True),
    ),
    head_counts=llama_head_counts,
    attr_fixes=(
        AttrFix("**.self_attn", "num_key_value_groups", lambda ctx: ctx.heads_local // ctx.kv_local),
        AttrFix("**.self_attn", "num_heads", lambda ctx: ctx.heads_local),
        AttrFix("**.self_attn", "num_key_value_heads", lambda ctx: ctx.kv_local),
    ),
    embedding="**.embed_tokens",
)
