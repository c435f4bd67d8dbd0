"""Check that a model converted to tensor parallelism is still the same model.

Each of N local processes builds the unconverted reference and the TP model (from a built-in config
with the same seed, or from a local directory: reference via ``from_pretrained``, TP model via the
slice-by-slice loader), runs one forward and backward on the same batch, and measures the largest
relative error of the logits, the loss and every parameter's gradient (gathered to full shape).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from transformers import PretrainedConfig

from mtk.checkpoint.hf_load import load_pretrained_tp
from mtk.convert import parallelize
from mtk.errors import CheckpointError
from mtk.models import DTYPES, ModelSpecError, auto_class_for, build_model, resolve_config
from mtk.parallel.expert_parallel import local_experts_implementation, reduce_expert_gradients
from mtk.parallel.gather import iter_full_tensors
from mtk.parallel.parameters import param_info
from mtk.parallel.record import parallelized
from mtk.parallel.state import ParallelState
from mtk.pipeline.batches import token_mean_loss
from mtk.pipeline.engine import PipelineModel
from mtk.rules import UnsupportedModelError
from mtk.testing import max_rel_error

__all__ = ["VERIFY_DTYPES", "VerifyResult", "verify_worker"]


@dataclass
class VerifyResult:
    """What one rank measured; ``error`` is set instead when the model could not be converted."""

    model_class: str = ""
    rule_set: str = ""
    logits: float = 0.0
    loss: float = 0.0
    grads: float = 0.0
    worst_param: str = ""
    num_params: int = 0
    error: str = ""
    rounding: dict[str, float] | None = None  # HF's own fp32 error against fp64 truth, per quantity


def _eager_experts(model):
    """MoE experts looped in plain matmuls: torch's grouped matmul takes no fp64 (experts spread over EP keep their
    exchange and loop over their own experts)."""
    if local_experts_implementation(model, "eager"):
        return model
    if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        model.set_experts_implementation("eager")
    return model


def _rounding(reference, inputs: dict[str, Any], ref_logits: torch.Tensor, grad_scale: float) -> dict[str, float]:
    """How far HF's own fp32 model is from the fp64 truth on the same input: the scale rounding alone reaches."""
    truth = _eager_experts(copy.deepcopy(reference).double())
    truth.zero_grad(set_to_none=True)
    out = _reference_loss(truth, inputs, torch.float64)
    out.loss.backward()
    with torch.no_grad():
        truth_logits = truth(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        loss = _reference_loss(reference, inputs, torch.float32).loss
    grads = dict(truth.named_parameters())
    worst = max(
        max_rel_error(p.grad.double(), grads[n].grad, scale_floor=1e-3 * grad_scale)
        for n, p in reference.named_parameters()
        if p.grad is not None and grads[n].grad is not None
    )
    return {
        "logits": max_rel_error(ref_logits.double(), truth_logits),
        "loss": max_rel_error(loss.double(), out.loss),
        "gradients": worst,
    }


def _batch(config, batch: int, seq: int, seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(
        0,
        min(config.vocab_size, 256) if config.vocab_size > 256 else config.vocab_size,
        (batch, seq),
        generator=generator,
    )
    if config.model_type == "bert":
        return dict(input_ids=ids, labels=torch.randint(0, config.num_labels, (batch,), generator=generator))
    return dict(input_ids=ids, labels=ids, use_cache=False)  # training's call: no KV cache (hybrids need none)


def _models(spec: str | PretrainedConfig, parallel: ParallelState, dtype: torch.dtype, seed: int):
    """The HF reference and its parallel counterpart. A directory's parallel model is read slice by slice, as
    training reads it; an encoder saved without its classification head (``BertModel``, as classify.py takes) has
    no head to read: its parallel model is the reference's copy, whose fresh head is drawn from ``seed`` on every
    rank alike."""
    if isinstance(spec, str) and Path(spec).is_dir():
        config = resolve_config(spec)
        kind = auto_class_for(config)
        torch.manual_seed(seed)  # (a head the directory lacks starts from it)
        try:
            reference = kind.from_pretrained(spec, dtype=dtype, use_safetensors=True)
        except (OSError, ValueError, RuntimeError, SafetensorError) as err:  # a damaged or foreign weights file
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CheckpointError(f"{spec}: transformers cannot load its weights ({first[:200]})") from None
        names = getattr(config, "architectures", None) or []
        if kind.__name__.endswith("SequenceClassification") and not any("Classification" in n for n in names):
            return reference.eval(), parallelize(copy.deepcopy(reference), parallel).eval()
        return reference.eval(), load_pretrained_tp(spec, parallel, dtype=dtype).eval()
    reference = build_model(spec, seed=seed, dtype=dtype).eval()
    return reference, parallelize(copy.deepcopy(reference), parallel).eval()


VERIFY_DTYPES = {**DTYPES, "fp64": torch.float64}


def _reference_loss(reference, inputs: dict[str, Any], dtype: torch.dtype):
    """The reference's output; in fp64 its causal-LM loss is recomputed in fp64 (HF's loss casts the logits
    with ``.float()``, a downcast for an fp64 model, so its own loss is not the fp64 truth)."""
    if dtype != torch.float64 or reference.config.model_type == "bert":
        return reference(**inputs)
    out = reference(**{k: v for k, v in inputs.items() if k != "labels"})
    logits, labels = out.logits[:, :-1], inputs["labels"][:, 1:]  # token t predicts t+1
    out.loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    if getattr(out, "aux_loss", None) is not None:  # MoE: the load-balancing term HF adds to the loss
        out.loss = out.loss + reference.router_aux_loss_coef * out.aux_loss
    return out


def verify_worker(
    rank: int,
    world_size: int,
    spec: str | PretrainedConfig,
    dtype: str,
    batch: int,
    seq: int,
    seed: int,
    rounding: bool = False,
    ep_size: int = 1,
    etp_size: int | None = None,
) -> VerifyResult:
    """Run in each of ``world_size`` processes (TP = world size / ``ep_size``); returns this rank's measurements.

    ``rounding`` (fp32): also measure HF's own fp32 model against an fp64 copy of it on the same input, the
    error rounding alone reaches on this model (deep real models cross a flat 1e-5 by rounding alone).
    ``ep_size`` > 1: the MoE layers' experts spread over ``ep_size`` data-parallel replicas, each running the
    same batch; each rank's experts then hold ``ep`` times one batch's gradient, averaged over the replicas as
    training does (:func:`~mtk.parallel.expert_parallel.reduce_expert_gradients`), and every expert's is compared
    once gathered over EP. ``etp_size``: the experts' TP size (the TP size, or 1: each expert whole on every TP rank,
    which runs them on its share of the tokens)."""
    parallel = ParallelState.build(tp_size=world_size // ep_size, ep_size=ep_size, etp_size=etp_size)
    try:
        reference, model = _models(spec, parallel, VERIFY_DTYPES[dtype], seed)
        if dtype == "fp64":
            reference, model = _eager_experts(reference), _eager_experts(model)
    except (UnsupportedModelError, ModelSpecError, CheckpointError) as err:
        return VerifyResult(error=str(err))
    inputs = _batch(reference.config, batch, seq, seed)
    ref_out = _reference_loss(reference, inputs, VERIFY_DTYPES[dtype])
    ref_out.loss.backward()
    out = model(**inputs)
    out.loss.backward()
    reduce_expert_gradients(list(model.parameters()), parallel.expert_replica_group, parallel.dp_size)
    with torch.no_grad():
        no_labels = {k: v for k, v in inputs.items() if k != "labels"}
        logits = model(**no_labels).logits
        ref_logits = reference(**no_labels).logits
    ref_grads = dict(reference.named_parameters())
    grad_scale = max(p.grad.abs().max().item() for p in ref_grads.values() if p.grad is not None)
    result = VerifyResult(
        model_class=type(reference).__name__,
        rule_set=record.rule_set.name if (record := parallelized(model)) else "?",
        logits=max_rel_error(logits.double(), ref_logits.double()),
        loss=max_rel_error(out.loss.double(), ref_out.loss.double()),
    )
    for name, grad in iter_full_tensors(model, parallel.tp_group, grads=True):
        # Gradients that are exactly zero in theory (softmax-invariant biases) are measured
        # against 1e-3 of the model's largest gradient instead of against their own rounding noise.
        error = max_rel_error(grad.double(), ref_grads[name].grad.double(), scale_floor=1e-3 * grad_scale)
        result.num_params += 1
        if error >= result.grads:
            result.grads, result.worst_param = error, name
    if rounding and dtype == "fp32":
        result.rounding = _rounding(reference, inputs, ref_logits, grad_scale)
    return result


def pipeline_verify_worker(
    rank: int, world_size: int, spec: str | PretrainedConfig, pp_size: int, seed: int = 0
) -> VerifyResult:
    """The model cut into ``pp_size`` stages (TP = world / pp inside each) and run by the 1F1B schedule over 2
    micro-batches: its loss and every gradient (gathered over TP, on the stage that owns it) against the unconverted
    model accumulating the same 2 (each row's token losses over the batch's count, and an MoE's load-balancing term
    per micro-batch, as one process accumulating gradients computes them)."""

    parallel = ParallelState.build(tp_size=world_size // pp_size, pp_size=pp_size)
    try:
        reference, model = _models(spec, parallel, torch.float32, seed)
    except (UnsupportedModelError, ModelSpecError, CheckpointError) as err:
        return VerifyResult(error=str(err))
    inputs = _batch(reference.config, 4, 12, seed)
    count = inputs["labels"][:, 1:].numel()  # every token a label: the micro-batches' losses over the batch's count
    weighted = {"num_items_in_batch": count / 2} if token_mean_loss(reference, inputs) else {}
    halves = [
        {k: v[rows] if torch.is_tensor(v) else v for k, v in inputs.items()} for rows in (slice(0, 2), slice(2, 4))
    ]
    ref_loss = torch.stack([reference(**half, **weighted).loss for half in halves]).mean()
    ref_loss.backward()
    pipe = PipelineModel(model, parallel, num_micro_batches=2)
    loss = pipe(**inputs).loss
    pipe.finalize_grads()
    ref_grads = dict(reference.named_parameters())
    grad_scale = max(p.grad.abs().max().item() for p in ref_grads.values() if p.grad is not None)
    result = VerifyResult(
        model_class=type(reference).__name__,
        rule_set=record.rule_set.name if (record := parallelized(model)) else "?",
        logits=float("nan"),  # the schedule returns the loss only
        loss=max_rel_error(loss.double(), ref_loss.double()),
    )
    for name, grad in iter_full_tensors(model, parallel.tp_group, grads=True):
        info = param_info(model.get_parameter(name))
        expected = ref_grads[info.tied_to or name].grad
        error = max_rel_error(grad.double(), expected.double(), scale_floor=1e-3 * grad_scale)
        result.num_params += 1
        if error >= result.grads:
            result.grads, result.worst_param = error, name
    return result
