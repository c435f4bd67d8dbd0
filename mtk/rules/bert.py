"""BERT encoders: self-attention split by heads, the MLP by columns then rows, word embeddings by
vocabulary. Position and token-type embeddings, LayerNorms, the pooler and task heads (such as
``BertForSequenceClassification``'s classifier) stay replicated: they are small and their loss is
computed by HF as usual.
"""

from mtk.rules.base import COLUMN, ROW, VOCAB, AttrFix, HeadCounts, Rule, RuleSet, SharedInput


def bert_head_counts(config) -> HeadCounts:
    heads = config.num_attention_heads
    return HeadCounts(heads, heads, config.hidden_size // heads, config.intermediate_size)


BERT = RuleSet(
    name="bert",
    model_types=("bert",),
    rules=(
        Rule("**.encoder.layer.*.attention.self.query", COLUMN),
        Rule("**.encoder.layer.*.attention.self.key", COLUMN),
        Rule("**.encoder.layer.*.attention.self.value", COLUMN),
        Rule("**.encoder.layer.*.attention.output.dense", ROW),
        Rule("**.encoder.layer.*.intermediate.dense", COLUMN),
        Rule("**.encoder.layer.*.output.dense", ROW),
        Rule("**.embeddings.word_embeddings", VOCAB),
    ),
    head_counts=bert_head_counts,
    attr_fixes=(
        AttrFix("**.encoder.layer.*.attention.self", "num_attention_heads", lambda ctx: ctx.heads_local),
        AttrFix("**.encoder.layer.*.attention.self", "all_head_size", lambda ctx: ctx.heads_local * ctx.head_dim),
    ),
    embedding="**.embeddings.word_embeddings",
    # self-attention: q/k/v read its input only; the intermediate dense is the MLP's one column
    shared_inputs=(SharedInput("**.encoder.layer.*.attention.self"), SharedInput("**.encoder.layer.*.intermediate")),
    layers="**.encoder.layer",
    split_random=("**.encoder.layer.*.attention.self",),
    residual_dropouts=("**.encoder.layer.*.attention.output.dropout", "**.encoder.layer.*.output.dropout"),
)
