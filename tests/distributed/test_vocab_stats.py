"""TRL's per-token statistics over vocab-parallel logits, and TRL's fused LM head on a converted model.

One spawn per TP size runs every check: the statistics against plain torch on the full vocabulary (padding
with junk in it, ignored targets, the last real column, argmax ties across ranks, TRL's logit transform),
their gradients and collective counts; at TP=2 also the fused forward of a converted tiny Llama against TRL's
own ``add_fused_lm_head`` on the unconverted model (and a tiny Mixtral for the load-balancing loss): every
output field, the loss and every gradient.
"""

import pytest
import torch

from mtk.errors import ConfigError
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


def _tiny_llama(seed: int, moe: bool = False, **config_overrides):
    """A Llama (or, with ``moe``, a Mixtral whose forward adds the load-balancing loss) of 2 tiny layers."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig

    if moe:
        config_overrides.update(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)
        config_overrides.update(router_aux_loss_coef=0.5)
    config = (MixtralConfig if moe else LlamaConfig)(
        vocab_size=101,  # padded to 102 at tp=2
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **config_overrides,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # logits of a few units, not ~0.1: peaked distributions, a softcap that bites
    return model


def _batch():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 101, (2, 12), generator=generator)
    ids[0, 5] = 100  # a label at the last real column
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100  # a prompt
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _objective(out):
    """The loss plus an entropy bonus, so the entropy's gradient is checked too (GRPO's)."""
    entropy = 0.0 if out.entropy is None else 0.1 * out.entropy.sum() / out.label_mask.sum().clamp(min=1)
    return out.loss + entropy


def _compare_fused(model, reference, state, inputs, what: str) -> None:
    """``model(**inputs, fused_lm_head=True)`` (converted) vs the same call on ``reference`` (TRL's)."""
    from mtk.parallel.gather import iter_full_tensors

    for m in (model, reference):
        m.zero_grad(set_to_none=True)
    ref = reference(**inputs, fused_lm_head=True)
    _objective(ref).backward()
    out = model(**inputs, fused_lm_head=True)
    _objective(out).backward()
    assert type(out) is type(ref), what
    assert_close_rel(out.loss, ref.loss, f"{what}: loss")
    for name in STATISTICS[:-1]:
        if getattr(ref, name) is None:
            assert getattr(out, name) is None, f"{what}: {name}"
        else:
            assert_close_rel(getattr(out, name), getattr(ref, name), f"{what}: {name}")
    assert (out.is_top1 is None) == (ref.is_top1 is None), what
    for name in ("is_top1", "label_mask") if ref.is_top1 is not None else ("label_mask",):
        assert torch.equal(getattr(out, name), getattr(ref, name)), f"{what}: {name}"
    if ref.aux_loss is None:
        assert out.aux_loss is None, what
    else:
        assert_close_rel(out.aux_loss, ref.aux_loss, f"{what}: aux_loss")
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    scale = max(g.abs().max().item() for g in ref_grads.values())
    compared = 0
    for name, grad in iter_full_tensors(model, state.tp_group, grads=True):
        assert_close_rel(grad, ref_grads[name], f"{what}: grad of {name}", scale_floor=1e-3 * max(scale, 1e-30))
        compared += 1
    assert compared == len(ref_grads), what


def _fused_head_checks(accelerator) -> None:
    from trl.trainer.utils import add_fused_lm_head

    from mtk.convert import parallelize
    from mtk.rules import add_vocab_parallel_fused_head

    state = accelerator.parallel
    batch = _batch()
    every = tuple(STATISTICS)

    # TRL's head added after conversion (through mtk), defaults but every output
    reference = _tiny_llama(0)
    model = parallelize(_tiny_llama(0), state)
    add_fused_lm_head(reference, outputs=every)
    add_vocab_parallel_fused_head(model, outputs=every)
    _compare_fused(model, reference, state, {**batch, "num_items_in_batch": torch.tensor(17)}, "after")
    plain_ref, plain = reference(**batch), model(**batch)  # without fused_lm_head: the model's own forward
    assert_close_rel(plain.loss, plain_ref.loss, "plain forward loss")
    fused = model(**batch, fused_lm_head=True)
    assert_close_rel(fused.loss, plain.loss, "TRL: at temperature 1 the fused loss is the model's own")
    all_ignored = {**batch, "labels": torch.full_like(batch["labels"], -100)}
    _compare_fused(model, reference, state, all_ignored, "all labels ignored")
    shifted = {k: v for k, v in batch.items() if k != "labels"}
    shifted["shift_labels"] = torch.cat([batch["labels"][:, 1:], torch.full((2, 1), -100)], dim=1)
    _compare_fused(model, reference, state, shifted, "shift_labels")

    # As TRL's trainers do: the user converts, the trainer's __init__ adds TRL's head, train() prepares
    model = accelerator.parallelize(_tiny_llama(0))
    add_fused_lm_head(model, outputs=every)
    model = accelerator.prepare(model)
    _compare_fused(model, reference, state, batch, "prepared")

    # TRL's head added before conversion, with a temperature, a softcap and a logit scale read from the config
    options = dict(final_logit_softcapping=3.0, logit_scale=0.5)
    reference = _tiny_llama(0, **options)
    model = _tiny_llama(0, **options)
    for m in (reference, model):
        add_fused_lm_head(m, temperature=0.7, outputs=("log_probs", "entropy", "is_top1"))
    parallelize(model, state)
    _compare_fused(model, reference, state, batch, "before, T=0.7, softcap, scale")

    # MoE: the load-balancing loss joins the loss (the experts are split over TP, the router is not)
    reference, model = _tiny_llama(0, moe=True), _tiny_llama(0, moe=True)
    for m in (reference, model):
        add_fused_lm_head(m, outputs=("log_probs", "entropy"))
    parallelize(model, state)
    _compare_fused(model, reference, state, batch, "MoE")

    # TRL's head added after conversion and never replaced: refused, not computed over a shard
    model = parallelize(_tiny_llama(0), state)
    add_fused_lm_head(model)
    with pytest.raises(ConfigError, match="vocabulary shard"):
        model(**batch, fused_lm_head=True)


def _checks(rank: int, world_size: int) -> dict:
    if world_size != 2:
        return _stats_checks(ParallelState.build(tp_size=world_size))
    from mtk import Accelerator, ParallelConfig

    accelerator = Accelerator(parallel_config=ParallelConfig(tp_size=2))
    counts = _stats_checks(accelerator.parallel)
    _fused_head_checks(accelerator)
    return counts


@pytest.mark.parametrize("tp", [2, 3])
def test_token_stats_and_fused_head_match_the_full_vocabulary(tp):
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


def _pipelined_moe_fused_head(rank: int, world_size: int) -> int:
    """TRL's own fused head (TP 1) on a Qwen3-MoE cut into 2 stages: its load-balancing term, computed by TRL with
    Mixtral's function, sums every stage's routers (carried with the hidden states)."""
    import copy

    from trl.trainer.utils import add_fused_lm_head

    from mtk.convert import parallelize
    from mtk.data.batching import loss_tokens
    from mtk.models import build_model
    from mtk.pipeline.engine import PipelineModel

    state = ParallelState.build(pp_size=2)
    reference = build_model("tiny-qwen3-moe", seed=0)
    reference.config.router_aux_loss_coef = 0.5
    model = copy.deepcopy(reference)
    for m in (reference, model):
        add_fused_lm_head(m, outputs=("log_probs", "entropy"))
    pipe = PipelineModel(parallelize(model, state), state, num_micro_batches=2)
    batch = _batch()  # 2 rows, the second right-padded: one row per micro-batch
    out = pipe(**batch, fused_lm_head=True)
    pipe.finalize_grads()
    count = loss_tokens(batch)
    rows = [reference(**{k: v[[r]] for k, v in batch.items()}, fused_lm_head=True, num_items_in_batch=count / 2)
            for r in range(2)]  # fmt: skip
    torch.stack([r.loss for r in rows]).mean().backward()
    assert_close_rel(out.loss, torch.stack([r.loss for r in rows]).mean().detach(), "loss")
    assert_close_rel(out.aux_loss, torch.stack([r.aux_loss for r in rows]).mean().detach(), "aux_loss")
    assert_close_rel(out.log_probs, torch.cat([r.log_probs for r in rows]).detach(), "log_probs")
    wanted = dict(reference.named_parameters())
    scale = max(p.grad.abs().max().item() for p in wanted.values() if p.grad is not None)
    compared = 0
    for name, param in model.named_parameters():
        expected = wanted[name].grad
        assert_close_rel(param.grad, expected, f"{name} grad", scale_floor=1e-3 * scale)
        compared += 1
    return compared


def test_trls_fused_head_on_a_pipelined_moe_sums_every_stages_routers():
    """PP 2, TRL's fused head on Qwen3-MoE with its load-balancing term: loss, aux_loss, log-probabilities and every
    stage's gradients equal one process accumulating the same 2 micro-batches (the router of stage 0 included)."""
    assert all(n > 0 for n in run_distributed(_pipelined_moe_fused_head, world_size=2))
