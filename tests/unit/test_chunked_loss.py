"""The chunked LM-head loss on one process: the same per-token loss and gradients as ``F.cross_entropy`` of the
full logits (fp64 to the last digits, fp32 within 1e-5), whatever the chunking; TP padding rows take no mass;
a frozen head gets no gradient; under autocast it matches the unfused path's bf16 head."""

import pytest
import torch
import torch.nn.functional as F
from transformers import Gemma2Config, GraniteConfig, LlamaConfig

from mtk.parallel.chunked_loss import chunk_tokens_for, chunked_vocab_parallel_cross_entropy
from mtk.parallel.loss import vocab_parallel_cross_entropy
from mtk.rules.lm_head import logits_transform
from mtk.testing import assert_close_rel

VOCAB, PADDED, HIDDEN = 50, 56, 16


def _case(dtype: torch.dtype, bias: bool = True):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 19, HIDDEN, dtype=dtype, generator=generator).requires_grad_()
    weight = torch.randn(PADDED, HIDDEN, dtype=dtype, generator=generator).requires_grad_()
    bias_ = torch.randn(PADDED, dtype=dtype, generator=generator).requires_grad_() if bias else None
    target = torch.randint(0, VOCAB, (2, 19), generator=generator)
    target[0, :4] = -100
    target[1, -1] = VOCAB - 1  # the last real row, next to the padding
    upstream = torch.randn(2, 19, dtype=dtype, generator=generator)  # an arbitrary d(total)/d(loss per token)
    return hidden, weight, bias_, target, upstream


def _grads(tensors):
    grads = [None if t is None else t.grad.clone() for t in tensors]
    for t in tensors:
        if t is not None:
            t.grad = None
    return grads


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk", [1, 7, 38, 1000, None])
@pytest.mark.parametrize("bias", [True, False])
def test_chunked_equals_cross_entropy_of_the_full_logits(dtype, tol, chunk, bias):
    hidden, weight, bias_, target, upstream = _case(dtype, bias)
    tensors = (hidden, weight, bias_)
    real_bias = None if bias_ is None else bias_[:VOCAB]
    logits = F.linear(hidden, weight[:VOCAB], real_bias)  # [2, 19, V]: the padding rows do not exist
    reference = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")  # [2, 19], 0 where ignored
    (reference * upstream).sum().backward()
    expected = _grads(tensors)

    losses = chunked_vocab_parallel_cross_entropy(
        hidden, weight, bias_, target, None, vocab_start=0, vocab_size=VOCAB, chunk_tokens=chunk
    )
    (losses * upstream).sum().backward()
    assert losses.shape == target.shape and losses.dtype == dtype
    assert_close_rel(losses, reference, "per-token loss", tol=tol)
    got = _grads(tensors)
    for name, grad, want in zip(("hidden", "weight", "bias"), got, expected):
        if want is not None:
            assert_close_rel(grad, want, f"grad of {name}", tol=tol)
    assert not got[1][VOCAB:].any(), "the TP padding rows take no probability mass, so no gradient"


def test_a_frozen_head_gets_no_gradient_and_its_input_the_right_one():
    hidden, weight, _, target, upstream = _case(torch.float64, bias=False)
    weight.requires_grad_(False)
    reference = F.cross_entropy(F.linear(hidden, weight[:VOCAB]).transpose(1, 2), target, reduction="none")
    (reference * upstream).sum().backward()
    expected = hidden.grad.clone()
    hidden.grad = None
    losses = chunked_vocab_parallel_cross_entropy(
        hidden, weight, None, target, None, vocab_start=0, vocab_size=VOCAB, chunk_tokens=5
    )
    (losses * upstream).sum().backward()
    assert weight.grad is None
    assert_close_rel(hidden.grad, expected, "grad of hidden", tol=1e-12)


def test_under_autocast_it_matches_the_unfused_bf16_head():
    """The head's matmul runs in autocast's dtype in forward and backward, the softmax in fp32: the loss is the
    unfused path's to fp32 rounding, the gradients to bf16's."""
    hidden, weight, _, target, upstream = _case(torch.float32, bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(hidden, weight)  # [2, 19, 56] bf16
        reference = vocab_parallel_cross_entropy(logits, target, None, vocab_size=VOCAB, reduction="none")
    (reference * upstream).sum().backward()
    expected = _grads((hidden, weight))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = chunked_vocab_parallel_cross_entropy(
            hidden, weight, None, target, None, vocab_start=0, vocab_size=VOCAB, chunk_tokens=6
        )
    (losses * upstream).sum().backward()
    assert_close_rel(losses, reference, "loss under autocast", tol=1e-5)
    for name, got, want in zip(("hidden", "weight"), _grads((hidden, weight)), expected):
        assert_close_rel(got, want, f"grad of {name} under autocast", tol=2e-2)


def test_bad_arguments_are_one_line():
    hidden, weight, _, target, _ = _case(torch.float32, bias=False)
    with pytest.raises(ValueError, match="chunk_tokens must be at least 1"):
        chunked_vocab_parallel_cross_entropy(hidden, weight, None, target, None, vocab_start=0, vocab_size=VOCAB,
                                             chunk_tokens=-1)  # fmt: skip
    with pytest.raises(ValueError, match="disagree before the last dim"):
        chunked_vocab_parallel_cross_entropy(hidden, weight, None, target[:, :3], None, vocab_start=0,
                                             vocab_size=VOCAB)  # fmt: skip


def test_auto_chunks_hold_at_most_256_mib_of_fp32_logits():
    assert chunk_tokens_for(151936 // 2) == 256 * 2**20 // (4 * 75968) == 883
    assert chunk_tokens_for(10**12) == 1


def test_models_that_change_their_logits_are_named():
    assert logits_transform(LlamaConfig()) is None
    assert logits_transform(Gemma2Config(final_logit_softcapping=30.0)) == "final_logit_softcapping=30.0"
    assert logits_transform(Gemma2Config(final_logit_softcapping=None)) is None
    cohere_like = LlamaConfig()
    cohere_like.logit_scale = 0.0625
    assert logits_transform(cohere_like) == "logit_scale=0.0625"
    assert logits_transform(GraniteConfig()) == "logits_scaling=1.0", "Granite divides whatever the value"
