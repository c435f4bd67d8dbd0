"""OLMo2 and OLMo3: Llama's layout, with RMSNorms over the *whole* q and k projections (not per head).

transformers' tp plan gathers q/k/v for those norms (``colwise_gather_output``) and cuts o_proj's input again:
exact, but the attention runs whole on every rank. Here the heads stay split: each norm all-reduces its sum of
squares (:class:`~mtk.parallel.norms.SplitRMSNorm`, one ``[b, s, 1]`` all-reduce) and keeps its slice of the
weight. kv heads must be split, not replicated: a replicated kv head would count in the k norm's sum once per
copy.
"""

from mtk.rules.base import SPLIT_NORM, HeadCounts, Rule, RuleSet
from mtk.rules.llama import LLAMA, llama_head_counts


def olmo2_head_counts(config) -> HeadCounts:
    counts = llama_head_counts(config)
    return HeadCounts(
        counts.num_heads,
        counts.num_kv_heads,
        counts.head_dim,
        counts.intermediate_size,
        False,
        "k norm over all kv heads",
    )


_NORMS = (Rule("**.layers.*.self_attn.q_norm", SPLIT_NORM), Rule("**.layers.*.self_attn.k_norm", SPLIT_NORM))

OLMO2 = RuleSet(
    name="olmo2",
    model_types=("olmo2", "olmo3"),
    rules=_NORMS + tuple(rule for rule in LLAMA.rules if "_norm" not in rule.pattern),
    head_counts=olmo2_head_counts,
    attr_fixes=LLAMA.attr_fixes,
    embedding=LLAMA.embedding,
    pipeline=LLAMA.pipeline,
    shared_inputs=LLAMA.shared_inputs,
    split_random=LLAMA.split_random,
)
