"""Sequence parallelism equals the unconverted HF model (and so TP without it): logits, loss, every gradient.

Each rank builds the HF model, converts a copy with ``sequence_parallel=True`` and compares in fp32
(relative error <= 1e-5) after summing the sequence-parallel gradients over TP, as the Accelerator does
after backward. The collectives are counted: per TP block one all-gather and one reduce-scatter replace
the all-reduce (same bytes), plus one all-gather where the blocks end.
"""

import copy

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from mtk.convert import parallelize
from mtk.errors import ConfigError
from mtk.models import build_model, builtin_config
from mtk.parallel import ParallelState
from mtk.parallel.collective_count import count_collectives
from mtk.parallel.gather import iter_full_tensors
from mtk.parallel.grads import sync_sequence_parallel_grads
from mtk.parallel.parameters import param_info
from mtk.testing import assert_close_rel, run_distributed
from tests.distributed.test_architectures import ARCHITECTURES, _inputs

LAYERS = 2


def _sequence_parallel_checks(
    rank: int, world_size: int, name: str, length: int | None = None, mask: bool = True
) -> dict:
    state = ParallelState.build(tp_size=world_size)
    reference = build_model(name, seed=0).eval()
    model = parallelize(copy.deepcopy(reference), state, sequence_parallel=True).eval()
    batch = _inputs(name)  # 12 positions: divisible by tp 2 and 4; one row right-padded
    if length is not None:  # fewer, which mtk pads (masked) to the next multiple of tp and trims from the output
        batch = {k: v[:, :length] if v.dim() == 2 else v for k, v in batch.items()}
    if not mask:  # HF's default (attend everywhere); for an encoder, mtk must mask what it appends
        del batch["attention_mask"]

    ref_out = reference(**batch)
    ref_out.loss.backward()
    with count_collectives() as log:
        out = model(**batch)
    forward = dict(log.counts())
    with count_collectives() as log:
        out.loss.backward()
    backward = dict(log.counts())
    sync_sequence_parallel_grads(model, state.tp_group)
    assert_close_rel(out.loss, ref_out.loss, f"{name} loss")
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    assert_close_rel(logits, ref_out.logits, f"{name} logits")
    with torch.no_grad():  # the states between the blocks: every position (each rank's own before), and the last
        unlabelled = {k: v for k, v in batch.items() if k != "labels"}
        states = model(**unlabelled, output_hidden_states=True).hidden_states
        expected_states = reference(**unlabelled, output_hidden_states=True).hidden_states
    assert len(states) == len(expected_states)
    for layer, (mine, theirs) in enumerate(zip(states, expected_states)):
        assert_close_rel(mine, theirs, f"{name} hidden states {layer}")

    ref_grads = dict(reference.named_parameters())
    grad_scale = max(p.grad.abs().max().item() for p in ref_grads.values())
    compared = 0
    for param_name, grad in iter_full_tensors(model, state.tp_group, grads=True):
        assert_close_rel(
            grad, ref_grads[param_name].grad, f"{name} grad of {param_name}", scale_floor=1e-3 * grad_scale
        )
        compared += 1
    assert compared == len(ref_grads)
    marked = sorted(n for n, p in model.named_parameters() if param_info(p).sequence_parallel)
    return {"forward": forward, "backward": backward, "marked": marked}


CASES = [(name, 2) for name in ARCHITECTURES] + [(name, 4) for name in ("tiny-llama", "tiny-qwen3", "tiny-gpt2")]


@pytest.mark.parametrize("name,tp", CASES)
def test_sequence_parallel_equals_hf(name, tp):
    result = run_distributed(_sequence_parallel_checks, world_size=tp, args=(name,))[0]
    if name == "tiny-bert":
        assert result["forward"]["all_gather"] == 2 * LAYERS + 1
        assert result["forward"]["reduce_scatter"] == 2 * LAYERS
        return
    # Forward: the embedding's all-reduce and the loss's two stay; each of the 2 blocks per layer
    # all-gathers its input and reduce-scatters its output; the last layer's output is gathered once.
    assert result["forward"] == {"all_reduce": 1 + 2, "all_gather": 2 * LAYERS + 1, "reduce_scatter": 2 * LAYERS}
    # Backward mirrors it: reduce-scatter for each gather in front of a block, all-gather for each
    # reduce-scatter and for the split at layer 0; leaving the region needs nothing (own chunk).
    assert result["backward"]["reduce_scatter"] == 2 * LAYERS
    assert result["backward"]["all_gather"] == 2 * LAYERS + 1
    # the norms inside the blocks see a slice of the sequence: their gradients are summed over TP
    assert any("layernorm" in n or "ln_" in n or "LayerNorm" in n for n in result["marked"])


@pytest.mark.parametrize(
    "name,tp,length,mask",
    [("tiny-llama", 2, 11, True), ("tiny-gpt2", 4, 9, False), ("tiny-qwen3", 4, 10, True), ("tiny-bert", 2, 7, False)],
)
def test_a_length_the_tp_size_does_not_divide_is_padded_inside(name, tp, length, mask):
    """A user's own batches (padded to their longest example, not to a multiple of tp) give the unconverted
    model's loss, logits of their own length and gradients; the encoder's appended positions are masked."""
    run_distributed(_sequence_parallel_checks, world_size=tp, args=(name, length, mask))


def _four_d_mask(rank: int, world_size: int) -> str:
    state = ParallelState.build(tp_size=world_size)
    model = parallelize(build_model("tiny-llama", seed=0), state, sequence_parallel=True)
    try:
        model(input_ids=torch.zeros(1, 7, dtype=torch.long), attention_mask=torch.ones(1, 1, 7, 7))
    except ConfigError as error:
        return str(error)
    return ""


def test_an_indivisible_length_with_a_4d_mask_is_one_line():
    message = run_distributed(_four_d_mask, world_size=2)[0]
    assert "4-d attention mask and 7 positions" in message and "multiple of 2" in message


def _generate(rank: int, world_size: int) -> str:
    state = ParallelState.build(tp_size=world_size)
    reference = build_model("tiny-llama", seed=0).eval()
    model = parallelize(copy.deepcopy(reference), state, sequence_parallel=True).eval()
    prompt = torch.arange(3, 10).reshape(1, 7)  # 7 positions: padded to 8 inside
    greedy = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    expected = reference.generate(input_ids=prompt, **greedy)
    assert torch.equal(model.generate(input_ids=prompt, use_cache=False, **greedy), expected)
    with torch.no_grad():  # the caller's last positions, not the pad's (what generate without a cache asks)
        mask = torch.zeros(1, 7, dtype=torch.bool)
        mask[0, [1, 5]] = True
        for kept in (1, 2, torch.tensor([0, 6]), torch.tensor([[2, 6]]), mask):
            logits = model(input_ids=prompt, logits_to_keep=kept).logits
            assert_close_rel(logits, reference(input_ids=prompt, logits_to_keep=kept).logits, f"logits_to_keep {kept}")
        # a tuple (trimmed by name: it kept the pad's column), and [1, s] position ids for two rows (broadcast)
        two, positions = torch.arange(3, 17).reshape(2, 7), torch.arange(7)[None]
        expected_logits = reference(input_ids=two, position_ids=positions).logits
        assert_close_rel(model(input_ids=two, position_ids=positions, return_dict=False)[0], expected_logits, "tuple")
        # a cache of the caller's 7 positions, not of the padded 8 (its reuse is refused below)
        assert model(input_ids=prompt, use_cache=True).past_key_values.get_seq_length() == 7
        # a sliding window's layers keep no positions to cut: that cache stays padded (crop raised before)
        window = {**builtin_config("tiny-mistral").to_dict(), "sliding_window": 4}
        windowed_reference = MistralForCausalLM(MistralConfig(**window))
        windowed = parallelize(copy.deepcopy(windowed_reference.eval()), state, sequence_parallel=True).eval()
        assert_close_rel(windowed(input_ids=prompt, use_cache=True).logits,
                         windowed_reference(input_ids=prompt).logits, "sliding window")  # fmt: skip
    try:
        model.generate(input_ids=prompt, **greedy)
    except ConfigError as error:
        return str(error)
    return ""


def test_generate_under_sequence_parallelism_without_a_cache_equals_hf_and_with_one_is_one_line():
    """The decoding steps of generate's KV cache were padded to the TP size, the pads' keys and values went into the
    cache and the mask no longer matched it: other tokens, without an error."""
    message = run_distributed(_generate, world_size=2)[0]
    assert "runs with sequence parallelism" in message and "generate with use_cache=False" in message, message
