"""Pipeline parallelism equals the single-process HF model: loss, every gradient and the grad norm.

Each rank builds the full HF model from one seed as the reference, converts a copy (TP), cuts it to
its stage (PP) and runs the schedule on its data-parallel share of one global batch. Gradients are
gathered over TP and compared under HF names; every reference parameter must be compared on some
stage. fp32, relative error <= 1e-5.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from transformers import GPT2Config, LlamaConfig, Qwen2Config

from mtk.config import RunSettings
from mtk.convert import parallelize
from mtk.errors import ConfigError
from mtk.models import build_model, builtin_config
from mtk.parallel import ParallelState
from mtk.parallel.gather import gather_state_dict, iter_full_tensors
from mtk.parallel.grad_norm import clip_grad_norm_tp_
from mtk.parallel.grads import sync_sequence_parallel_grads
from mtk.parallel.parameters import param_info
from mtk.parallel.recompute import enable_recompute
from mtk.parallel.record import parallelized
from mtk.pipeline.engine import PipelineModel
from mtk.pipeline.schedules import schedule_order
from mtk.testing import assert_close_rel, run_distributed

GLOBAL_BATCH, SEQ = 8, 12


def deeper(name: str, layers: int) -> LlamaConfig | Qwen2Config | GPT2Config:
    """A built-in tiny model with more decoder layers (interleaving needs pp x v of them)."""
    config = builtin_config(name)
    config.num_hidden_layers = layers
    if hasattr(config, "layer_types"):  # Qwen2 lists one attention type per layer
        config.layer_types = [config.layer_types[0]] * layers
    return config


MODELS = {
    "four-layer-llama": lambda: deeper("tiny-llama", 4),
    "eight-layer-llama": lambda: deeper("tiny-llama", 8),
    "four-layer-gpt2": lambda: deeper("tiny-gpt2", 4),
    "four-layer-qwen2": lambda: deeper("tiny-qwen2", 4),
}


def _max_in_flight(order) -> int:
    held = peak = 0
    for step in order:
        held += 1 if step.kind == "F" else -1
        peak = max(peak, held)
    return peak


def _batch(seq: int = SEQ) -> dict[str, torch.Tensor]:
    """Right-padded rows of uneven length: micro-batches count different numbers of labelled tokens, so the
    pipeline must return the batch's token mean, not the mean of its micro-batches' means (each DP half has the
    same lengths, so the replicas' mean is the global token mean as on one process)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (GLOBAL_BATCH, seq), generator=generator)
    lengths = torch.tensor([seq, seq - 5, seq - 2, seq - 8] * (GLOBAL_BATCH // 4))
    mask = (torch.arange(seq) < lengths[:, None]).long()  # [b, s]
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def _pipeline_checks(
    rank,
    world_size,
    name,
    tp,
    pp,
    schedule,
    micro_batches,
    layers,
    virtual=1,
    recompute=None,
    sequence_parallel=False,
    seq=SEQ,
) -> dict:
    state = ParallelState.build(tp_size=tp, pp_size=pp)
    reference = build_model(name, seed=0).eval()  # eval: no dropout; gradients still flow
    batch = _batch(seq)
    ref_out = reference(**batch)
    ref_out.loss.backward()
    ref_grads = dict(reference.named_parameters())
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"), norm_type=2.0)

    model = parallelize(
        copy.deepcopy(reference),
        state,
        pipeline_layers=layers,
        virtual_stages=virtual,
        sequence_parallel=sequence_parallel,
    )
    record = parallelized(model)
    enable_recompute(model, RunSettings(recompute_granularity=recompute), record.rng)
    pipe = PipelineModel(model.eval(), state, micro_batches, schedule)
    pipe.syncs_this_call = lambda: True  # as mtk.Accelerator: the last backward starts the DP reduction
    share = GLOBAL_BATCH // state.dp_size
    local = {k: v[state.dp_rank * share : (state.dp_rank + 1) * share] for k, v in batch.items()}
    loss = pipe(**local).loss
    in_flight = pipe.stats.max_in_flight
    pipe.finalize_grads()
    if sequence_parallel:  # what mtk.Accelerator does after backward
        sync_sequence_parallel_grads(model, state.tp_group)
    mean_loss = loss.clone().reshape(1)
    if state.dp_size > 1:
        dist.all_reduce(mean_loss, group=state.dp_group)
        mean_loss /= state.dp_size
    assert_close_rel(mean_loss[0], ref_out.loss, f"{name} loss")

    grad_scale = max(p.grad.abs().max().item() for p in ref_grads.values())
    compared = []
    for param_name, grad in iter_full_tensors(model, state.tp_group, grads=True):
        param = model.get_parameter(param_name)
        expected = ref_grads[param_info(param).tied_to or param_name].grad
        assert_close_rel(grad, expected, f"{name} grad of {param_name}", scale_floor=1e-3 * grad_scale)
        if not param_info(param).pipeline_duplicate:
            compared.append(param_name)

    norm = clip_grad_norm_tp_(list(model.parameters()), float("inf"), state)
    assert_close_rel(norm, ref_norm, f"{name} grad norm")

    with torch.no_grad():  # forward-only schedule: the same loss, nothing held
        eval_loss = pipe(**local).loss
        # a tuple where one is asked for, flags that ask for nothing pass; the states are refused in one line (each
        # was a TypeError where the micro-batches are cut)
        as_tuple = pipe(**local, return_dict=False, output_hidden_states=False, logits_to_keep=0)
        assert len(as_tuple) == 1 and torch.equal(as_tuple[0], eval_loss)
        with pytest.raises(ConfigError, match="output_hidden_states=True with a pipelined model"):
            pipe(**local, output_hidden_states=True)
    assert_close_rel(eval_loss, loss, f"{name} eval loss")

    full = gather_state_dict(model, state)
    if rank == 0:
        expected_sd = reference.state_dict()
        assert sorted(full) == sorted(expected_sd), "the gathered state dict has HF's keys"
        for key, tensor in full.items():
            assert torch.equal(tensor, expected_sd[key]), key
    return {"compared": compared, "stage": state.pp_rank, "max_in_flight": in_flight}


CASES = [
    # name, tp, pp, dp, schedule, micro-batches per replica, layers per stage (per chunk), virtual stages
    ("tiny-llama", 1, 2, 1, "1f1b", 4, (), 1),
    ("tiny-gpt2", 1, 2, 1, "1f1b", 2, (), 1),  # tied head, learned positions on the first stage only
    ("tiny-qwen2", 2, 2, 1, "1f1b", 4, (), 1),  # tied head, vocab-parallel on both ends
    ("four-layer-llama", 1, 4, 1, "1f1b", 8, (), 1),
    ("four-layer-llama", 1, 2, 1, "1f1b", 2, (3, 1), 1),
    ("tiny-llama", 2, 2, 2, "1f1b", 2, (), 1),  # 8 processes: TP x PP x DP
    # interleaved: v chunks per rank, the ring wraps from the last rank to the first
    ("four-layer-llama", 1, 2, 1, "interleaved", 4, (), 2),
    ("four-layer-gpt2", 1, 2, 1, "interleaved", 2, (), 2),  # positions and dropout stand aside on chunk 1
    ("eight-layer-llama", 1, 4, 1, "interleaved", 8, (), 2),
    ("eight-layer-llama", 2, 4, 1, "interleaved", 4, (), 2),  # 8 processes: TP x PP, the ring over 4 stages
    ("eight-layer-llama", 1, 2, 1, "interleaved", 4, (1, 3, 2, 2), 2),  # uneven chunks
    ("four-layer-qwen2", 2, 2, 2, "interleaved", 2, (), 2),  # tied, vocab-parallel, TP x PP x DP
]


@pytest.mark.parametrize("name,tp,pp,dp,schedule,micro,layers,virtual", CASES)
def test_pipeline_equals_single_process(name, tp, pp, dp, schedule, micro, layers, virtual):
    spec = MODELS[name]() if name in MODELS else name
    results = run_distributed(
        _pipeline_checks,
        world_size=tp * pp * dp,
        args=(spec, tp, pp, schedule, micro, layers, virtual),
        timeout=300,
    )
    reference = build_model(spec, seed=0)
    names = {r["stage"]: r["compared"] for r in results}
    flat = [n for stage in sorted(names) for n in names[stage]]
    assert sorted(flat) == sorted(n for n, _ in reference.named_parameters()), "each parameter on exactly one stage"
    first_stage = max(r["max_in_flight"] for r in results if r["stage"] == 0)
    # 1F1B holds at most pp micro-batches of activations on the first stage; AFAB holds all of them;
    # interleaved holds its warm-up's chunk passes (each 1/v of a stage).
    assert first_stage == _max_in_flight(schedule_order(schedule, micro, 0, pp, virtual))
    if schedule == "1f1b":
        assert first_stage == min(pp, micro)


@pytest.mark.parametrize("recompute,sequence_parallel", [("full", False), ("selective", True)])
def test_interleaved_with_recompute_and_sequence_parallel(recompute, sequence_parallel):
    """The chunk views swap modules in and out between forward and backward: activation recompute reruns
    the blocks that ran, and sequence parallelism's split activations cross the ring."""
    results = run_distributed(
        _pipeline_checks,
        world_size=4,
        # (under sequence parallelism 11 positions: mtk pads them to 12 inside, masked)
        args=(MODELS["four-layer-llama"](), 2, 2, "interleaved", 4, (), 2, recompute, sequence_parallel, 11),
        timeout=300,
    )
    assert {r["stage"] for r in results} == {0, 1}


def _overlap_vs_blocking(rank, world_size, name, micro_batches, schedule, virtual) -> dict:
    """The same step twice on fresh copies: DP reduction overlapped with the last backward, and after the
    schedule; gradients must be equal bit for bit."""
    state = ParallelState.build(tp_size=1, pp_size=2)
    reference = build_model(MODELS[name]() if name in MODELS else name, seed=0).eval()
    share = GLOBAL_BATCH // state.dp_size
    local = {k: v[state.dp_rank * share : (state.dp_rank + 1) * share] for k, v in _batch().items()}
    grads, launched = {}, 0
    for overlap in (True, False):
        model = parallelize(copy.deepcopy(reference), state, virtual_stages=virtual)
        pipe = PipelineModel(model, state, micro_batches, schedule)
        pipe.syncs_this_call = (lambda: True) if overlap else None
        pipe(**local)
        if overlap:
            launched = pipe._reduction.launched  # buckets started inside backward, before finalize_grads
        pipe.finalize_grads()
        grads[overlap] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys()
    for key in grads[True]:
        assert torch.equal(grads[True][key], grads[False][key]), key
    return {"launched": launched}


@pytest.mark.parametrize(
    "name,schedule,virtual",
    [
        ("tiny-llama", "1f1b", 1),
        ("tiny-qwen2", "1f1b", 1),  # tied embeddings on both stages
        ("four-layer-qwen2", "interleaved", 2),  # each chunk's reduction starts at its own last backward
    ],
)
def test_overlapped_data_parallel_reduction_equals_the_blocking_one(name, schedule, virtual):
    results = run_distributed(_overlap_vs_blocking, world_size=4, args=(name, 2, schedule, virtual), timeout=300)
    assert all(r["launched"] >= 1 for r in results), "the reduction started inside backward"


def _classifiers_at_pp(rank: int, world_size: int) -> list[str]:
    from transformers import LlamaForSequenceClassification, LlamaForTokenClassification

    from mtk.errors import ConfigError

    state = ParallelState.build(tp_size=1, pp_size=world_size)
    config = builtin_config("tiny-llama")
    config.num_labels, config.pad_token_id = 3, 0
    said = []
    for kind in (LlamaForSequenceClassification, LlamaForTokenClassification):
        cut = parallelize(kind(config), state)
        try:
            PipelineModel(cut, state, num_micro_batches=2)
            said.append("accepted")
        except ConfigError as err:
            said.append(str(err))
    return said


def test_a_decoders_classifier_at_pp_is_one_line():
    """HF's decoder sequence classifiers pool each row at its last token that is not padding, found from the
    input_ids the last stage does not receive (HF pooled the padding: 0.961 for one process's 0.9996 on rows with
    padding), and a token classifier's loss, which takes no token count, was a mean of micro-batch means (1.074 for
    1.108): each trained on another loss, exit 0."""
    for sequence, token in run_distributed(_classifiers_at_pp, world_size=2):
        assert sequence.startswith("LlamaForSequenceClassification at pp > 1: the pipeline trains causal"), sequence
        assert token.startswith("LlamaForTokenClassification at pp > 1: the pipeline trains causal"), token
