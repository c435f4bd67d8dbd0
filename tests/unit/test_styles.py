"""Parallel styles are objects: rules name them (or their registered names), and a new style is one class."""

import copy
import pickle
from dataclasses import replace

import pytest
import torch
from torch import nn

from mtk.models import build_model
from mtk.parallel.state import ParallelState
from mtk.rules import Rule, parallelize_with
from mtk.rules.llama import LLAMA
from mtk.rules.styles import COLUMN, STYLES, ParallelStyle, register_style


def test_rules_name_a_style_by_object_or_by_name():
    assert Rule("**.q_proj", "column").style is COLUMN is Rule("**.q_proj", COLUMN).style
    assert copy.deepcopy(COLUMN) is COLUMN is pickle.loads(pickle.dumps(COLUMN))  # compared by identity
    with pytest.raises(ValueError, match=r"unknown style 'colum'; expected one of \('column', 'kv_column'"):
        Rule("**.q_proj", "colum")


class _Counted(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x)


class _CountedStyle(ParallelStyle):
    """Wraps a module to count its calls: splits nothing, so the output is the module's own."""

    name = "test_counted"

    def build(self, module, name, rule, ctx):
        return _Counted(module)


def test_a_new_style_is_one_registered_class():
    style = register_style(_CountedStyle())
    try:
        model = build_model("tiny-llama")
        ids = torch.randint(0, 100, (1, 8))
        expected = model(ids).logits
        rules = replace(LLAMA, rules=(Rule("**.layers.*.input_layernorm", "test_counted"), *LLAMA.rules))
        parallelize_with(model, ParallelState.build(), rules)
        counted = [m for m in model.modules() if isinstance(m, _Counted)]
        assert len(counted) == model.config.num_hidden_layers and style.splits_linear is False
        assert torch.equal(model(ids).logits, expected) and all(m.calls == 1 for m in counted)
    finally:
        STYLES.pop(style.name)
