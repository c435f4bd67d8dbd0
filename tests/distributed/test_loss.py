"""Vocab-parallel cross-entropy vs torch.nn.functional.cross_entropy on the gathered logits."""

import pytest
import torch
import torch.nn.functional as F

from mtk.parallel import ParallelState, vocab_parallel_cross_entropy
from mtk.parallel.collective_count import count_collectives
from mtk.parallel.comm import split
from mtk.testing import assert_close_rel, run_distributed

BATCH, SEQ = 3, 6


def _targets(vocab: int) -> torch.Tensor:
    target = torch.randint(0, vocab, (BATCH, SEQ))
    target[0, :2] = -100  # ignored tokens
    target[1, 0] = 0
    target[2, -1] = vocab - 1  # the last real column sits next to the padding
    return target


def _loss_checks(rank: int, world_size: int, vocab: int) -> dict:
    state = ParallelState.build(tp_size=world_size)
    group, tp = state.tp_group, state.tp_size
    torch.manual_seed(0)
    padded = -(-vocab // tp) * tp
    full = torch.randn(BATCH, SEQ, vocab) * 3
    # Padding columns get large junk values: they must take no probability mass and get no gradient.
    junk = torch.full((BATCH, SEQ, padded - vocab), 50.0)
    logits_padded = torch.cat([full, junk], dim=-1)  # [b, s, V_padded]
    target = _targets(vocab)
    counts = {}

    for reduction in ("mean", "sum", "none"):
        ref_logits = full.clone().requires_grad_()
        ref = F.cross_entropy(ref_logits.view(-1, vocab), target.view(-1), reduction=reduction)
        upstream = torch.rand_like(ref)
        (ref * upstream).sum().backward()

        local = split(logits_padded, group, dim=-1).clone().requires_grad_()  # [b, s, V_padded/tp]
        with count_collectives() as fwd:
            loss = vocab_parallel_cross_entropy(local, target, group, vocab_size=vocab, reduction=reduction)
        with count_collectives() as bwd:
            (loss.view(-1) * upstream.view(-1)).sum().backward() if reduction == "none" else (
                loss * upstream
            ).backward()
        assert_close_rel(loss.view(-1) if reduction == "none" else loss, ref, f"loss ({reduction})")
        grad_ref = torch.cat([ref_logits.grad, torch.zeros_like(junk)], dim=-1)
        assert_close_rel(local.grad, split(grad_ref, group, dim=-1), f"logit grad ({reduction})")
        counts[reduction] = {
            "forward": dict(fwd.counts()),
            "backward": dict(bwd.counts()),
            "bytes": fwd.bytes_by_kind()["all_reduce"],
        }
    return counts


@pytest.mark.parametrize("tp,vocab", [(2, 40), (2, 37), (4, 37)])
def test_vocab_parallel_cross_entropy_matches_torch(tp, vocab):
    for result in run_distributed(_loss_checks, world_size=tp, args=(vocab,)):
        for reduction, counts in result.items():
            # max, then [sum_exp, target_logit] stacked: two O(b*s) all-reduces, none backward.
            assert counts["forward"] == {"all_reduce": 2}, reduction
            assert counts["backward"] == {}, reduction
            assert counts["bytes"] == 3 * BATCH * SEQ * 4, "communication is O(b*s), independent of V"


def test_single_process_equals_torch_and_rejects_bad_reduction():
    torch.manual_seed(0)
    logits = torch.randn(4, 11, requires_grad=True)
    target = torch.tensor([1, -100, 10, 0])
    loss = vocab_parallel_cross_entropy(logits, target, None)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, target)
    loss.backward()
    ref.backward()
    assert_close_rel(loss, ref, "loss")
    assert_close_rel(logits.grad, ref_logits.grad, "grad")
    with pytest.raises(ValueError, match="reduction must be"):
        vocab_parallel_cross_entropy(logits, target, None, reduction="avg")


def test_backward_twice_is_a_clear_error():
    logits = torch.randn(2, 5, requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, torch.tensor([1, 2]), None)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="can be back-propagated once"):
        loss.backward()
