"""A ModelOutput with a field removed or set, as HF would have built it (mtk.parallel.model_outputs)."""

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from mtk.parallel.model_outputs import rebuilt_output


def test_a_removed_field_leaves_no_entry_and_a_set_one_keeps_hfs_place():
    loss, logits, states = torch.tensor(1.0), torch.zeros(1, 2, 3), (torch.ones(1, 2, 4),)
    output = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=states)
    output["extra"] = "a hook's"  # (an entry that is no field: kept)
    output.logits = None  # (what the attribute alone does: the entry stays)
    assert "logits" in output
    removed = rebuilt_output(output, logits=None)
    assert "logits" not in removed and removed.to_tuple()[:2] == (loss, states) and removed["extra"] == "a hook's"
    cached = rebuilt_output(removed, cache="a cache")
    assert list(cached.keys()) == ["loss", "cache", "hidden_states", "extra"]  # (HF's order: cache before states)
