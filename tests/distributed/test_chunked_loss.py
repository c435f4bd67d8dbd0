"""The chunked loss at TP = 2 and 4: the fused head + vocab-parallel cross-entropy equals torch's cross-entropy of
the full logits (loss, the head input's gradient summed over TP, each rank's weight and bias rows), with the same
two O(tokens) all-reduces as the unfused loss and none in backward; and a converted HF model trains through it by
default (its head defers, no logits come back), equal to the one-process HF model in loss and every gradient, with
sequence parallelism, over padded vocabularies and chunks smaller than a row."""

import copy

import pytest
import torch
import torch.nn.functional as F

import mtk.rules.lm_head as lm_head
from mtk.convert import parallelize
from mtk.errors import ConfigError
from mtk.models import build_model
from mtk.parallel import ParallelState
from mtk.parallel.chunked_loss import chunked_vocab_parallel_cross_entropy
from mtk.parallel.collective_count import count_collectives
from mtk.parallel.comm import split
from mtk.parallel.gather import iter_full_tensors
from mtk.parallel.grads import sync_sequence_parallel_grads
from mtk.rules.lm_head import logits_mode
from mtk.testing import assert_close_rel, run_distributed
from tests.distributed.test_architectures import _inputs

TOKENS, HIDDEN = 23, 12


def _function_checks(rank: int, world_size: int, vocab: int) -> dict:
    state = ParallelState.build(tp_size=world_size)
    group, tp = state.tp_group, state.tp_size
    generator = torch.Generator().manual_seed(0)
    padded = -(-vocab // tp) * tp
    hidden = torch.randn(TOKENS, HIDDEN, dtype=torch.float64, generator=generator)
    weight = torch.randn(padded, HIDDEN, dtype=torch.float64, generator=generator)
    bias = torch.randn(padded, dtype=torch.float64, generator=generator)
    weight[vocab:], bias[vocab:] = 9.0, 50.0  # junk padding rows: no probability mass, no gradient
    target = torch.randint(0, vocab, (TOKENS,), generator=generator)
    target[:3] = -100
    target[-1] = vocab - 1
    upstream = torch.rand(TOKENS, dtype=torch.float64, generator=generator)

    ref_inputs = [t[:vocab].clone().requires_grad_() if t is not hidden else t.clone().requires_grad_()
                  for t in (hidden, weight, bias)]  # fmt: skip
    reference = F.cross_entropy(F.linear(*ref_inputs), target, reduction="none")  # [N]
    (reference * upstream).sum().backward()

    rows = [split(t, group, dim=0).clone().requires_grad_() for t in (weight, bias)]  # this rank's [V_padded/tp]
    local = [hidden.clone().requires_grad_(), *rows]
    start = rank * (padded // tp)
    with count_collectives() as fwd:
        losses = chunked_vocab_parallel_cross_entropy(
            *local, target, group, vocab_start=start, vocab_size=vocab, chunk_tokens=4
        )
    with count_collectives() as bwd:
        (losses * upstream).sum().backward()
    assert_close_rel(losses, reference, "per-token loss", tol=1e-12)
    grad_hidden = local[0].grad.clone()
    torch.distributed.all_reduce(grad_hidden, group=group)  # what the head's entry into the TP region does
    assert_close_rel(grad_hidden, ref_inputs[0].grad, "grad of the head's input", tol=1e-12)
    for name, ref, got in (("weight", ref_inputs[1], local[1]), ("bias", ref_inputs[2], local[2])):
        full = torch.cat([ref.grad, torch.zeros(padded - vocab, *ref.shape[1:], dtype=ref.dtype)])
        assert not got.grad[max(0, vocab - start) :].any(), f"the padding rows of the {name} get no gradient"
        assert_close_rel(got.grad, split(full, group, dim=0), f"grad of the {name} rows", tol=1e-12)
    return {"forward": dict(fwd.counts()), "backward": dict(bwd.counts()), "bytes": fwd.bytes_by_kind()["all_reduce"]}


@pytest.mark.parametrize("tp,vocab", [(2, 40), (4, 37)])
def test_the_chunked_loss_equals_cross_entropy_of_the_full_logits(tp, vocab):
    for counts in run_distributed(_function_checks, world_size=tp, args=(vocab,)):
        assert counts["forward"] == {"all_reduce": 2}  # max of the log-sum-exps, then [sum exp, target logit]
        assert counts["backward"] == {}  # the input's gradient is summed by the head's entry, outside
        assert counts["bytes"] == 3 * TOKENS * 8, "communication is O(tokens), independent of the vocabulary"


def _model_checks(rank: int, world_size: int, name: str, sequence_parallel: bool) -> dict:
    calls = []
    chunked = lm_head.chunked_vocab_parallel_cross_entropy

    def counted(*args, **kwargs):
        calls.append(kwargs["chunk_tokens"])
        return chunked(*args, **kwargs)

    lm_head.chunked_vocab_parallel_cross_entropy = counted  # this worker's only
    state = ParallelState.build(tp_size=world_size)
    reference = build_model(name, seed=0).eval()
    model = parallelize(copy.deepcopy(reference), state, sequence_parallel=sequence_parallel, loss_chunk_tokens=5)
    model.eval()
    batch = _inputs(name)
    ref_out = reference(**batch)
    ref_out.loss.backward()
    out = model(**batch)
    out.loss.backward()
    sync_sequence_parallel_grads(model, state.tp_group)
    assert_close_rel(out.loss, ref_out.loss, f"{name} loss")
    ref_grads = dict(reference.named_parameters())
    compared = 0
    for param_name, grad in iter_full_tensors(model, state.tp_group, grads=True):
        assert_close_rel(grad, ref_grads[param_name].grad, f"{name} grad of {param_name}", scale_floor=1e-6)
        compared += 1
    assert compared == len(ref_grads)
    deferred = (len(calls), out.logits is None)
    with logits_mode(model, "full"), torch.no_grad():  # a caller that asks for the logits gets them
        full = model(**batch)
    assert_close_rel(full.logits, ref_out.logits, f"{name} logits")
    assert_close_rel(full.loss, ref_out.loss, f"{name} loss from the logits")
    return {"deferred": deferred, "after_full": len(calls)}


@pytest.mark.parametrize(
    "name,tp,sequence_parallel",
    [("tiny-llama", 2, True), ("tiny-gpt2", 2, False), ("tiny-qwen3", 4, True), ("tiny-phi3", 4, False)],
)
def test_a_converted_model_trains_through_the_chunked_loss_and_equals_hf(name, tp, sequence_parallel):
    for result in run_distributed(_model_checks, world_size=tp, args=(name, sequence_parallel)):
        assert result["deferred"] == (1, True), "the head deferred, the loss took it over, no logits came back"
        assert result["after_full"] == 1, "asking for the logits computes them, the loss from them"


def _refusal_checks(rank: int, world_size: int) -> dict:
    state = ParallelState.build(tp_size=world_size)
    batch = _inputs("tiny-llama")
    scaled = build_model("tiny-llama", seed=0)
    scaled.config.logit_scale = 0.5  # as Cohere's config says it
    errors = {}
    try:
        parallelize(copy.deepcopy(scaled), state, loss_chunk_tokens=8)
    except ConfigError as error:
        errors["explicit"] = str(error)
    unfused = parallelize(copy.deepcopy(scaled), state)  # unset: this model keeps the logits, then the loss
    errors["default_logits_dropped"] = unfused(**batch).logits is None
    # A model that changes its logits without its config saying so: the loss sees another tensor than the head's.
    model = parallelize(build_model("tiny-llama", seed=0), state)
    model.get_output_embeddings().register_forward_hook(lambda module, args, output: output * 2.0)
    try:
        model(**batch)
    except ConfigError as error:
        errors["unannounced"] = str(error)
    return errors


def test_a_model_that_changes_its_logits_is_refused_or_keeps_them():
    errors = run_distributed(_refusal_checks, world_size=2)[0]
    assert "changes its logits after the LM head (logit_scale=0.5)" in errors["explicit"]
    assert errors["default_logits_dropped"]
    assert "changes its logits between the LM head and the loss" in errors["unannounced"]
    assert "MTK_LOSS_CHUNK_TOKENS=0" in errors["unannounced"]
