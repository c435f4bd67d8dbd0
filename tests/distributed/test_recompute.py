"""Activation recomputation changes memory, never numbers: with dropout on, the same loss and gradients.

Dropout on split heads draws from the per-TP-rank stream, on replicated activations from the shared
one; recompute must replay both. Each case trains one step of two copies of a TP model with dropout,
one recomputing, from the same generator states, and compares loss and every gradient.
"""

import copy

import pytest
import torch

from mtk.config import RunSettings
from mtk.convert import parallelize
from mtk.models import build_model, resolve_config
from mtk.parallel import ParallelState
from mtk.parallel.comm import all_gather
from mtk.parallel.grads import sync_sequence_parallel_grads
from mtk.parallel.recompute import enable_recompute, recomputed_blocks
from mtk.parallel.record import parallelized
from mtk.testing import assert_close_rel, run_distributed

DROPOUT = {
    "tiny-llama": {"attention_dropout": 0.2},
    "tiny-gpt2": {"attn_pdrop": 0.2, "resid_pdrop": 0.2, "embd_pdrop": 0.2},
    "tiny-phi3": {"attention_dropout": 0.2, "resid_pdrop": 0.2},
}


def _with_dropout(name: str):
    config = resolve_config(name)
    for key, value in DROPOUT[name].items():
        setattr(config, key, value)
    config._attn_implementation = "eager"  # dropout on the probabilities in python: masks are drawn here
    return config


def _step(model, ids, tp_group) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(11)  # the same default stream for both copies; each copy's TP stream starts fresh
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    sync_sequence_parallel_grads(model, tp_group)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _recompute_checks(rank: int, world_size: int, name: str, sequence_parallel: bool, granularity: str) -> dict:
    state = ParallelState.build(tp_size=world_size)
    torch.manual_seed(0)
    hf = build_model(_with_dropout(name), seed=0).train()
    plain = parallelize(copy.deepcopy(hf), state, sequence_parallel=sequence_parallel)
    recomputing = parallelize(copy.deepcopy(hf), state, sequence_parallel=sequence_parallel)
    settings = RunSettings(recompute_granularity=granularity)
    enable_recompute(recomputing, settings, parallelized(recomputing).rng)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))

    loss, grads = _step(plain, ids, state.tp_group)
    loss_rc, grads_rc = _step(recomputing, ids, state.tp_group)
    assert_close_rel(loss_rc, loss, f"{name} loss with recompute")
    for param_name, grad in grads.items():
        assert_close_rel(grads_rc[param_name], grad, f"{name} grad of {param_name} with recompute")
    with torch.no_grad():
        plain.eval()
        eval_loss = plain(input_ids=ids, labels=ids).loss
        plain.train()
    # Replicated activations stay replicated under dropout: every TP rank's loss is the same.
    losses = all_gather(loss.reshape(1), state.tp_group, dim=0)
    return {
        "dropout_changed_loss": not torch.equal(eval_loss, loss),
        "tp_ranks_agree": bool((losses == losses[0]).all()),
        "recomputed": recomputed_blocks(recomputing),
    }


@pytest.mark.parametrize(
    "name,sequence_parallel,granularity",
    [
        ("tiny-llama", False, "full"),
        ("tiny-llama", True, "full"),
        ("tiny-llama", True, "selective"),
        ("tiny-gpt2", False, "full"),
        ("tiny-gpt2", True, "selective"),
        ("tiny-phi3", True, "full"),
    ],
)
def test_recompute_with_dropout_is_exact(name, sequence_parallel, granularity):
    for result in run_distributed(_recompute_checks, world_size=2, args=(name, sequence_parallel, granularity)):
        assert result["dropout_changed_loss"], "dropout is on: the test would prove nothing otherwise"
        assert result["tp_ranks_agree"]
        assert result["recomputed"] == [0, 1]


def _streams_checks(rank: int, world_size: int) -> dict:
    """Llama's only random draws are attention dropout on split heads: all from the TP stream."""
    state = ParallelState.build(tp_size=world_size)
    model = parallelize(build_model(_with_dropout("tiny-llama"), seed=0), state).train()
    streams = parallelized(model).rng
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    default_before, tp_before = torch.get_rng_state(), streams.state_dict()["tensor-parallel"]
    model(input_ids=ids, labels=ids)
    tp_after = streams.state_dict()["tensor-parallel"]
    return {
        "default_untouched": torch.equal(torch.get_rng_state(), default_before),
        "tp_advanced": not torch.equal(tp_after, tp_before),
        "tp_state": tp_before,
    }


def test_attention_dropout_draws_from_the_tp_stream():
    first, second = run_distributed(_streams_checks, world_size=2)
    for result in (first, second):
        assert result["default_untouched"] and result["tp_advanced"]
    assert not torch.equal(first["tp_state"], second["tp_state"]), "each TP rank has its own stream"


def test_block_method_recomputes_the_first_layers():
    model = build_model("tiny-llama", seed=0)
    enable_recompute(
        model, RunSettings(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    )
    assert recomputed_blocks(model) == [0]


def _everything_recomputed(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.PREFER_RECOMPUTE


def _hf_checkpointing_checks(rank: int, world_size: int) -> dict:
    """HF's own checkpointing turned on by the user, before the conversion and after it, reentrant, with a
    context of the user's own: each trains as the copy without checkpointing."""
    import contextlib
    import io
    from functools import partial

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    state = ParallelState.build(tp_size=world_size)
    hf = build_model(_with_dropout("tiny-gpt2"), seed=0).train()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    plain = parallelize(copy.deepcopy(hf), state)  # (every copy converted before any step: the same TP seed)
    before = copy.deepcopy(hf)
    before.gradient_checkpointing_enable()
    ways = {"before the conversion": parallelize(before, state)}
    printed = io.StringIO()
    for way, kwargs in [
        ("after the conversion", None),
        ("reentrant", {"use_reentrant": True}),
        ("with the user's context", {"use_reentrant": False, "context_fn": partial(
            create_selective_checkpoint_contexts, _everything_recomputed)}),
    ]:  # fmt: skip
        model = parallelize(copy.deepcopy(hf), state)
        with contextlib.redirect_stdout(printed):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        ways[way] = model
    loss, grads = _step(plain, ids, state.tp_group)
    for way, model in ways.items():
        assert recomputed_blocks(model) == [0, 1], way
        loss_ckpt, grads_ckpt = _step(model, ids, state.tp_group)
        assert_close_rel(loss_ckpt, loss, f"loss with HF's checkpointing {way}")
        for name, grad in grads.items():
            assert_close_rel(grads_ckpt[name], grad, f"grad of {name} with HF's checkpointing {way}")
    return {"printed": printed.getvalue()}


def test_hf_checkpointing_turned_on_by_the_user_keeps_the_tp_stream():
    """``model.gradient_checkpointing_enable()`` in a user's own loop reran each block with only torch's live
    generator restored: the TP stream's attention-dropout masks of the rerun were others than the forward's, and
    the gradients were not the loss's (no word)."""
    first, second = run_distributed(_hf_checkpointing_checks, world_size=2)
    said = "mtk: activation checkpointing with use_reentrant=True runs non-reentrant"
    assert first["printed"].startswith(said) and first["printed"].count("\n") == 1, first["printed"]
    assert not second["printed"]
