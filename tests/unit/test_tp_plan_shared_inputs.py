"""Which modules of transformers' tp plans take their columns' input into the TP region once."""

import pytest
from transformers import CohereConfig, OlmoeConfig, Qwen3MoeConfig

from mtk.rules.from_tp_plan import rules_from_tp_plan


@pytest.mark.parametrize(
    "config, shared",
    [
        (CohereConfig(), ["**.layers.*.mlp", "**.layers.*.self_attn"]),  # q/k/v and gate/up
        (OlmoeConfig(), ["**.layers.*.self_attn"]),  # gathered q/k/v are columns too; the MoE block is not shared
        (Qwen3MoeConfig(), ["**.layers.*.self_attn"]),  # its mlp names dense gate/up and experts: the router reads it
    ],
)
def test_sibling_columns_share_their_input_and_sequence_parallelism_stays_off(config, shared):
    rule_set, why = rules_from_tp_plan(config)
    assert rule_set is not None, why
    assert sorted(s.pattern for s in rule_set.shared_inputs) == shared
    assert all(s.argument is None for s in rule_set.shared_inputs)  # read from each module's forward
    assert not rule_set.sequence_parallel
