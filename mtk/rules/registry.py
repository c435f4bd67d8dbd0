"""Which rules serve a model (:func:`resolve_rules`); :func:`mtk.convert.parallelize` applies it.

Registered family plans are chosen by ``config.model_type``. A model no family names is tried with
the generic rules, but only after they pass a parity check: a one-layer random copy of the model is
converted and its logits compared with the unconverted copy on every rank.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from mtk.models import with_layers
from mtk.parallel.comm import all_reduce
from mtk.parallel.gather import full_shape_and_spec, gather_full_tensor
from mtk.parallel.state import ParallelState
from mtk.rules.apply import parallelize_with
from mtk.rules.base import RuleSet, UnsupportedModelError
from mtk.rules.bert import BERT
from mtk.rules.from_tp_plan import rules_from_tp_plan
from mtk.rules.generic import GENERIC
from mtk.rules.gpt2 import GPT2
from mtk.rules.llama import LLAMA
from mtk.rules.olmo2 import OLMO2
from mtk.rules.phi3 import PHI3
from mtk.testing import max_rel_error

__all__ = ["RULE_SETS", "check_tp_size", "find_rules", "register_rules", "resolve_rules"]

RULE_SETS: list[RuleSet] = [LLAMA, GPT2, BERT, PHI3, OLMO2]
PARITY_TOLERANCE = 1e-4  # one layer in fp32 on random weights; real mismatches are O(1)

_HOW_TO_ADD = "add a rule file under mtk/rules/ and register it (docs/architectures.md, 'Adding an architecture')"


def register_rules(rule_set: RuleSet) -> None:
    """Make ``rule_set`` serve its ``model_types`` (a later registration wins)."""
    RULE_SETS.insert(0, rule_set)


def find_rules(config, tp_size: int | None = None) -> RuleSet | None:
    """The registered (hand-written) rules for ``config.model_type``, else the ones transformers' own
    ``base_model_tp_plan`` gives (:mod:`mtk.rules.from_tp_plan`), else ``None``. With ``tp_size``, hand-written rules
    that cannot take it gives way to HF's when that one can (OLMo2's split norms need split kv heads; HF's
    plan gathers and takes any tp the heads allow)."""
    hand = next((rule_set for rule_set in RULE_SETS if config.model_type in rule_set.model_types), None)
    if hand is not None and (tp_size is None or hand.head_counts(config).problem(tp_size) is None):
        return hand
    from_hf = rules_from_tp_plan(config)[0]
    if hand is not None and (from_hf is None or from_hf.head_counts(config).problem(tp_size or 1) is not None):
        return hand  # neither takes this tp: the hand rule set's line says why
    return from_hf


def _is_registered(rule_set: RuleSet) -> bool:
    return any(rule_set is known for known in RULE_SETS)


def check_tp_size(config, tp_size: int) -> None:
    """Raise a one-line :class:`UnsupportedModelError` when ``tp_size`` cannot split this model.

    Cheap (config only): call it before launching processes or building groups.
    """
    rule_set = find_rules(config, tp_size)
    try:
        counts = (rule_set or GENERIC).head_counts(config)
    except AttributeError as err:  # the generic rules read decoder-style config fields (T5 has none)
        families = sorted({t for known in RULE_SETS for t in known.model_types})
        raise UnsupportedModelError(
            f"{config.model_type}: mtk has no rules for this architecture and the generic ones do not fit it "
            f"({err}); supported: {', '.join(families)} and decoder models like them (docs/architectures.md, "
            f"'Adding an architecture')"
        ) from None
    problem = counts.problem(tp_size)
    if problem:
        raise UnsupportedModelError(
            f"{config.model_type}: {problem}; valid tp sizes for this model: {counts.valid_tp_sizes(limit=64)}"
        )


def _one_layer_config(config):
    """``config`` with one decoder layer, or (a hybrid with ``layer_types``) the fewest first layers that hold one of
    each type: a rule that is right for one kind of layer and wrong for another fails the parity check."""
    types = list(getattr(config, "layer_types", None) or [])
    return with_layers(config, max(types.index(t) for t in set(types)) + 1 if types else 1)


def _check_parity(model_class: type, config, parallel: ParallelState, rule_set: RuleSet = GENERIC) -> None:
    """Convert a one-layer random copy with ``rule_set`` (the generic rules, or ones derived from HF's tp plan);
    raise unless its logits and every gradient match (a shared input that also fed something else inside its
    module would change gradients only)."""
    small = _one_layer_config(config)
    small._attn_implementation = "eager"
    if getattr(small, "output_router_logits", False):  # logits compared; a dense first layer would give no routers
        small.output_router_logits = False
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(0)  # identical copy and batch on every rank
    try:
        reference = model_class._from_config(small, torch_dtype=torch.float32).eval()  # type: ignore[attr-defined]
        input_ids = torch.randint(0, small.vocab_size, (2, 8))
    finally:
        torch.random.set_rng_state(generator_state)
    converted = copy.deepcopy(reference)
    try:
        parallelize_with(converted, parallel, rule_set)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"no rules for model_type {config.model_type!r} ({err}); {_HOW_TO_ADD}") from None
    expected = reference(input_ids).logits
    try:
        actual = converted(input_ids).logits
    except RuntimeError as err:  # e.g. a norm over all heads fed one rank's heads: shapes disagree
        first_line = str(err).strip().splitlines()[0]
        raise UnsupportedModelError(
            f"no rules for model_type {config.model_type!r}: the {rule_set.name} rules convert "
            f"{model_class.__name__} but its forward then fails ({first_line}); {_HOW_TO_ADD}"
        ) from None
    worst = ("its logits", max_rel_error(actual.detach(), expected.detach()))
    probe = torch.linspace(-1, 1, expected.numel()).reshape(expected.shape)  # [b, s, V]: every logit weighted
    (expected * probe).sum().backward()
    (actual * probe).sum().backward()
    reference_params = dict(reference.named_parameters())
    # gradients that are zero in theory (softmax-invariant key biases) are rounding noise: measured against the
    # model's largest gradient, as mtk verify measures them
    floor = 1e-3 * max((p.grad.abs().max().item() for p in reference_params.values() if p.grad is not None), default=0)
    for name, param in converted.named_parameters():  # the same on every TP rank: each gathers together
        expected_grad = reference_params[name].grad if name in reference_params else None
        if param.grad is None or expected_grad is None:
            continue
        shape, spec = full_shape_and_spec(converted, name)
        grad = gather_full_tensor(param.grad, spec, shape, parallel.tp_group)
        grad_error = max_rel_error(grad, expected_grad, scale_floor=floor)
        if grad_error > worst[1]:
            worst = (f"the gradient of {name}", grad_error)
    error = torch.tensor([worst[1]])
    if dist.is_initialized():
        all_reduce(error, parallel.tp_group, op=dist.ReduceOp.MAX)  # every rank decides the same way
    if not error.item() <= PARITY_TOLERANCE:
        raise UnsupportedModelError(
            f"no rules for model_type {config.model_type!r}: the {rule_set.name} rules convert "
            f"{model_class.__name__} but it differs from the original in {worst[0]} (relative error "
            f"{error.item():.1e}); {_HOW_TO_ADD}"
        )


def resolve_rules(model: nn.Module, parallel: ParallelState) -> RuleSet:
    """The rules that convert ``model``: its family's, else the one from transformers' tp plan, else the
    generic rules; the last two once they pass a parity check on a one-layer random copy (collective over
    the TP group)."""
    rule_set = find_rules(model.config, parallel.tp_size)
    if rule_set is not None and _is_registered(rule_set):
        return rule_set
    candidate = rule_set or GENERIC
    problem = candidate.head_counts(model.config).problem(parallel.tp_size)
    if problem is None:  # sizes first: a clear size error beats a parity run that cannot pass
        try:
            _check_parity(type(model), model.config, parallel, candidate)
        except UnsupportedModelError:
            if not candidate.shared_inputs:
                raise
            # shared inputs derived from HF's plan whose module feeds more than its columns: one copy per column
            candidate = replace(candidate, shared_inputs=())
            _check_parity(type(model), model.config, parallel, candidate)
    return candidate
