"""GPT-2: Conv1D weights ([in, out], kept as HF stores them), a fused ``c_attn`` and a tied lm_head.

``c_attn`` computes ``[q; k; v]`` in one matrix: it is split per part (each of q, k and v by heads),
not into thirds of the fused matrix. GPT-2's attention splits the fused output with ``split_size``,
so that attribute (and the head count) become per-rank values. Learned positions stay replicated.
Pipeline stages after the first see ``wpe`` as zeros and ``drop`` as identity: the first stage
already added positions and applied dropout to the activations it sends.
"""

from mtk.rules.base import (
    COLUMN,
    IDENTITY,
    LM_HEAD,
    REMOVE,
    ROW,
    VOCAB,
    ZEROS,
    AttrFix,
    HeadCounts,
    PipelineSpec,
    Rule,
    RuleSet,
    SharedInput,
)


def gpt2_head_counts(config) -> HeadCounts:
    return HeadCounts(
        config.n_head, config.n_head, config.n_embd // config.n_head, config.n_inner or 4 * config.n_embd
    )


GPT2 = RuleSet(
    name="gpt2",
    model_types=("gpt2",),
    rules=(
        Rule("**.h.*.attn.c_attn", COLUMN, parts=lambda config: [config.n_embd] * 3),
        Rule("**.h.*.attn.c_proj", ROW),
        Rule("**.h.*.mlp.c_fc", COLUMN),
        Rule("**.h.*.mlp.c_proj", ROW),
        Rule("**.wte", VOCAB),
        Rule("lm_head", LM_HEAD, optional=True),
    ),
    head_counts=gpt2_head_counts,
    attr_fixes=(
        AttrFix("**.h.*.attn", "split_size", lambda ctx: ctx.hidden_local),
        AttrFix("**.h.*.attn", "num_heads", lambda ctx: ctx.heads_local),
        AttrFix("**.h.*.attn", "embed_dim", lambda ctx: ctx.hidden_local),
    ),
    embedding="**.wte",
    pipeline=PipelineSpec(
        layers="**.h",
        first_stage=(("**.wte", REMOVE), ("**.wpe", ZEROS), ("**.drop", IDENTITY)),
        last_stage=(("**.ln_f", IDENTITY), ("lm_head", REMOVE)),
    ),
    shared_inputs=(SharedInput("**.h.*.attn"), SharedInput("**.h.*.mlp")),
    split_random=("**.h.*.attn",),  # attention dropout on this rank's heads
    residual_dropouts=("**.h.*.attn.resid_dropout", "**.h.*.mlp.dropout"),
)
