"""TRL's per-token statistics over vocab-parallel logits.

One spawn per TP size runs every check: the statistics against plain torch on the full vocabulary (padding
with junk in it, ignored targets, the last real column, argmax ties across ranks, TRL's logit transform),
their gradients and collective counts.
"""

import pytest
import torch

from mtk.parallel import ParallelState
from mtk.parallel.collective_count import count_collectives
from mtk.parallel.comm import split
from mtk.parallel.vocab_stats import STATISTICS, vocab_parallel_token_stats
from mtk.testing import assert_close_rel, run_distributed

BATCH, SEQ, VOCAB = 3, 8, 37  # 37 is divisible by neither 2 nor 3: the last rank holds padding
TRANSFORMS = [  # (temperature, final_logit_softcapping, logit_scale)
    (1.0, None, 1.0),
    (0.7, 5.0, 0.5),
]


def _reference(logits, target, temperature, softcap, scale):
    """The definitions, in plain torch (fp64) on the full vocabulary: TRL's transform, then softmax."""
    z = logits.double() * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z * (1 / temperature)
    valid = target != -100
    log_p = z.log_softmax(-1)  # [b, s, V]
    stats = {
        "log_probs": log_p.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1),
        "entropy": -(log_p.exp() * log_p).sum(-1),
        "log_sum_sq_probs": torch.logsumexp(2 * log_p, dim=-1),
        "mean_logits": z.mean(-1),
        "is_top1": z.argmax(-1) == target,  # torch.argmax: the first maximal index
    }
    return {k: v & valid if v.dtype == torch.bool else v * valid for k, v in stats.items()}


def _targets_and_logits():
    torch.manual_seed(0)
    logits = torch.randn(BATCH, SEQ, VOCAB) * 3
    target = torch.randint(0, VOCAB, (BATCH, SEQ))
    target[0, :2] = -100  # ignored
    target[1, 0] = 0
    target[2, -1] = VOCAB - 1  # the last real column, next to the padding
    # is_top1 ties (exact, so they survive the transform): the first maximal index wins, across ranks too
    ties = [  # (row, target, columns holding the maximum)
        (0, 30, (2, 30)),  # an earlier column (rank 0) holds the same maximum: not top-1
        (1, 2, (2, 30)),  # the target is the first of the tied maxima: top-1
        (2, 13, (12, 13)),  # tie across the tp=3 boundary (rank 0 ends at 12): not top-1
        (3, 12, (12, 13)),  # top-1
        (4, VOCAB - 1, (VOCAB - 1,)),  # unique maximum at the last real column: top-1
        (5, VOCAB - 1, (0, VOCAB - 1)),  # not top-1
    ]
    for position, label, columns in ties:
        logits[1, position] = logits[1, position].round()
        logits[1, position, list(columns)] = 20.0
        target[1, position] = label
    target[1, 6] = -100  # an ignored target whose row has a unique maximum: still False
    return logits, target


def _stats_checks(state: ParallelState) -> dict:
    group, tp = state.tp_group, state.tp_size
    full, target = _targets_and_logits()
    padded = -(-VOCAB // tp) * tp
    junk = torch.full((BATCH, SEQ, padded - VOCAB), 50.0)
    junk[0, 0] = float("nan")  # even NaN in a padded column takes no part, forward or backward
    logits_padded = torch.cat([full, junk], dim=-1)  # [b, s, V_padded]
    counts = {}
    for temperature, softcap, scale in TRANSFORMS:
        ref_logits = full.double().requires_grad_()
        ref = _reference(ref_logits, target, temperature, softcap, scale)
        w_lp, w_h = torch.rand(BATCH, SEQ, dtype=torch.float64), torch.rand(BATCH, SEQ, dtype=torch.float64)
        ((ref["log_probs"] * w_lp).sum() + (ref["entropy"] * w_h).sum()).backward()

        local = split(logits_padded, group, dim=-1).clone().requires_grad_()  # [b, s, V_padded/tp]
        transform = dict(temperature=temperature, final_logit_softcapping=softcap, logit_scale=scale)
        with count_collectives() as forward:
            stats = vocab_parallel_token_stats(local, target, group, vocab_size=VOCAB, **transform)
        with count_collectives() as backward:
            ((stats.log_probs * w_lp).sum() + (stats.entropy * w_h).sum()).backward()
        what = f"tp={tp} T={temperature} softcap={softcap} scale={scale}"
        for name in STATISTICS[:-1]:
            assert_close_rel(getattr(stats, name), ref[name], f"{name} ({what})")
        assert torch.equal(stats.is_top1, ref["is_top1"]), f"is_top1 ({what}): {stats.is_top1} vs {ref['is_top1']}"
        assert stats.is_top1[1, :6].tolist() == [False, True, False, True, True, False], what
        grad_ref = torch.cat([ref_logits.grad.float(), torch.zeros_like(junk)], dim=-1)
        assert_close_rel(local.grad, split(grad_ref, group, dim=-1), f"logit grad ({what})")

        with count_collectives() as log_probs_only:
            alone = vocab_parallel_token_stats(
                local, target, group, vocab_size=VOCAB, outputs=("log_probs",), **transform
            )
        assert alone.entropy is None and torch.equal(alone.log_probs, stats.log_probs)
        counts[what] = [dict(c.counts()) for c in (forward, backward, log_probs_only)]
    return counts


def _checks(rank: int, world_size: int) -> dict:
    return _stats_checks(ParallelState.build(tp_size=world_size))


@pytest.mark.parametrize("tp", [2, 3])
def test_token_stats_match_the_full_vocabulary(tp):
    for counts in run_distributed(_checks, world_size=tp):
        for what, (forward, backward, log_probs_only) in counts.items():
            # cross-entropy (max; sum_exp and target) + moments (max, before-target max; sums): O(tokens) each
            assert forward == {"all_reduce": 4}, what
            assert backward == {}, what
            assert log_probs_only == {"all_reduce": 2}, what


def test_single_process_is_plain_torch():
    full, target = _targets_and_logits()
    for temperature, softcap, scale in TRANSFORMS:
        stats = vocab_parallel_token_stats(
            full, target, None, temperature=temperature, final_logit_softcapping=softcap, logit_scale=scale
        )
        ref = _reference(full, target, temperature, softcap, scale)
        for name in STATISTICS[:-1]:
            assert_close_rel(getattr(stats, name), ref[name], name)
        assert torch.equal(stats.is_top1, ref["is_top1"])
    with pytest.raises(ValueError, match="unknown statistics"):
        vocab_parallel_token_stats(full, target, None, outputs=("log_probs", "logits"))
