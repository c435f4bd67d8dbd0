"""How the hooks that change a call's positions (sequence parallelism's padding, context parallelism's split) read
its arguments: every positional one by name, and what a ``**kwargs`` parameter gathers beside them."""

import inspect

from mtk.parallel.sequence_padding import named_arguments


def _forward(input_ids=None, attention_mask=None, labels=None, **kwargs):
    return None


def test_positional_arguments_are_read_by_name_with_the_keyword_ones_beside():
    signature = inspect.signature(_forward)
    named = named_arguments(signature, ("ids", "mask"), {"labels": "y", "num_items_in_batch": 7})
    # (the **kwargs parameter's own name stayed in the result before, as a nested dict the model then received)
    assert named == {"input_ids": "ids", "attention_mask": "mask", "labels": "y", "num_items_in_batch": 7}


def test_a_signature_without_a_keyword_catch_all():
    signature = inspect.signature(lambda input_ids, attention_mask=None: None)
    assert named_arguments(signature, ("ids",), {"attention_mask": "m"}) == {"input_ids": "ids", "attention_mask": "m"}


def test_embeddings_alone_are_padded_for_a_causal_lm_and_refused_where_the_last_position_is_read():
    """A causal LM's appended positions change nothing; a sequence classifier given embeddings alone pools the
    row's last position (HF finds it by pad ids it then has not), which would be an appended one."""
    import pytest
    import torch

    from mtk.errors import ConfigError
    from mtk.parallel.sequence_padding import pad_batch

    embeds = torch.randn(2, 7, 4)
    padded, extra = pad_batch({"input_ids": None, "inputs_embeds": embeds}, 2)
    assert extra == 1 and padded["inputs_embeds"].shape == (2, 8, 4)
    with pytest.raises(ConfigError, match="inputs_embeds alone and 7 positions"):
        pad_batch({"input_ids": None, "inputs_embeds": embeds}, 2, pad_token_id=0, causal=False)
