"""No caller reads a vocabulary shard as the logits (TP = 2, a vocabulary of 101 padded to 102).

``auto``: full logits without labels, ``None`` with labels (the loss alone, as Megatron); ``full``: always the
full logits; ``shard``: the documented opt-in to this rank's columns; ``logits_mode`` switches for a block.
"""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mtk.convert import parallelize
from mtk.models import build_model
from mtk.parallel import ParallelState
from mtk.rules.lm_head import logits_mode
from mtk.testing import assert_close_rel, run_distributed

VOCAB = 101


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _contract(rank: int, world_size: int) -> None:
    reference, model = _model(), _model()
    parallelize(model, ParallelState.build(tp_size=world_size))
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=ids, labels=ids)
        plain = model(input_ids=ids)
        assert_close_rel(plain.logits, expected.logits, "logits without labels")
        with_labels = model(input_ids=ids, labels=ids)
        assert with_labels.logits is None  # auto: the loss alone, never half a vocabulary
        # nor by key, index or tuple (the field's entry stayed when only the attribute was set to None)
        assert "logits" not in with_labels and len(with_labels.to_tuple()) == 2  # (loss, cache)
        assert not isinstance(with_labels[1], torch.Tensor)
        assert_close_rel(with_labels.loss, expected.loss, "loss")
        as_tuple = model(input_ids=ids, labels=ids, return_dict=False)
        assert len(as_tuple) == len(reference(input_ids=ids, labels=ids, return_dict=False)) - 1
        with logits_mode(model, "full"):
            full = model(input_ids=ids, labels=ids)
        assert_close_rel(full.logits, expected.logits, "full logits with labels")
        assert model(input_ids=ids, labels=ids).logits is None  # the mode is back to auto after the block
        with logits_mode(model, "shard"):
            shard = model(input_ids=ids).logits
        assert shard.shape == (2, 11, 102 // world_size)
        assert_close_rel(shard[..., : min(VOCAB - 51 * rank, 51)], expected.logits[..., 51 * rank : 51 * (rank + 1)],
                         "this rank's columns")  # fmt: skip


def _whole_heads(rank: int, world_size: int, sequence_parallel: bool) -> None:
    """output_attentions: every head's weights (each rank's own heads before), with and without return_dict;
    under sequence parallelism at a length it pads, without the pad's query and key (11 positions, not 12)."""
    reference, model = _model(), _model()
    for m in (reference, model):
        m.set_attn_implementation("eager")  # (the implementation that returns its weights)
    parallelize(model, ParallelState.build(tp_size=world_size), sequence_parallel=sequence_parallel)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=ids, output_attentions=True).attentions
        for got in (model(input_ids=ids, output_attentions=True).attentions,
                    model(ids, output_attentions=True, return_dict=False)[-1]):  # fmt: skip
            assert len(got) == len(expected) == 2
            for layer, (mine, theirs) in enumerate(zip(got, expected)):
                assert_close_rel(mine, theirs, f"attention weights of layer {layer}")
        if sequence_parallel:  # the states between the blocks, whole, from embeddings too; a selection's None kept
            for length in (10, 11):  # (input_ids=None beside them, as generate passes: no length, no padding)
                embeds = reference.get_input_embeddings()(ids[:, :length])
                got = model(input_ids=None, inputs_embeds=embeds, output_hidden_states=True).hidden_states
                want = reference(inputs_embeds=embeds, output_hidden_states=True).hidden_states
                for layer, (mine, theirs) in enumerate(zip(got, want, strict=True)):
                    assert_close_rel(mine, theirs, f"hidden states {layer} from embeddings, {length} positions")
            chosen = model(input_ids=ids, output_hidden_states=[1]).hidden_states
            assert chosen[0] is None and chosen[2] is None
            assert_close_rel(chosen[1], reference(input_ids=ids, output_hidden_states=True).hidden_states[1], "[1]")


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_attention_weights_are_every_heads(sequence_parallel):
    run_distributed(_whole_heads, world_size=2, args=(sequence_parallel,))


def _moe_tuples(rank: int, world_size: int) -> None:
    """return_dict=False on an MoE model, whose tuple holds aux_loss before the logits: HF's tuple in HF's order,
    without the logits where labels are given (index 1 was taken as the logits: aux_loss dropped and the vocabulary
    shard kept, or a traceback without labels)."""
    reference = build_model("tiny-qwen3-moe", seed=0).eval()
    model = parallelize(copy.deepcopy(reference), ParallelState.build(tp_size=world_size))
    ids = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for labels in (None, ids):
            expected = reference(input_ids=ids, labels=labels, output_router_logits=True)
            names = [key for key in expected if not (key == "logits" and labels is not None)]
            got = model(input_ids=ids, labels=labels, output_router_logits=True, return_dict=False)
            assert len(got) == len(names), (names, [type(v).__name__ for v in got])
            for name, value in zip(names, got):
                if isinstance(value, torch.Tensor):
                    assert_close_rel(value, expected[name], f"{name} (labels: {labels is not None})")
                elif name == "router_logits":
                    for mine, theirs in zip(value, expected[name], strict=True):
                        assert_close_rel(mine, theirs, "router logits")


def test_an_moe_models_tuple_is_hfs_by_name():
    run_distributed(_moe_tuples, world_size=2)


def test_logits_are_full_or_none_never_a_shard():
    run_distributed(_contract, world_size=2)
