"""Which optimizers mtk lets update tensor-parallel shards: every element on its own (AdamW, SGD) runs; a whole
tensor's statistics (Adafactor, LAMB) or state quantized in blocks of the flattened tensor (bitsandbytes' and
torchao's 8-bit and 4-bit optimizers, whatever their class is called) is one line; an unknown one is reported."""

from types import SimpleNamespace

import pytest
import torch

from mtk.errors import ConfigError
from mtk.parallel.optimizer_updates import check_elementwise_update


def _optimizer(class_name: str, module: str, **attributes: object) -> torch.optim.Optimizer:
    """An SGD standing in for ``module.class_name`` (the check reads the class's name and module only)."""
    cls = type(class_name, (torch.optim.SGD,), {"__module__": module})
    optimizer = cls([torch.nn.Parameter(torch.zeros(4, 4))], lr=0.1)
    for key, value in attributes.items():
        setattr(optimizer, key, value)
    return optimizer


def _check(optimizer: torch.optim.Optimizer) -> list[str]:
    said: list[str] = []
    check_elementwise_update(optimizer, optimizer.param_groups[0]["params"], said.append)
    return said


@pytest.mark.parametrize(
    "class_name,module,attributes",
    [
        ("AdamW", "bitsandbytes.optim.adamw", {"args": SimpleNamespace(optim_bits=8)}),  # --optim adamw_8bit
        ("PagedAdamW8bit", "bitsandbytes.optim.adamw", {}),
        ("Lion", "bitsandbytes.optim.lion", {"args": SimpleNamespace(optim_bits=8)}),  # --optim lion_8bit
        ("AdamW4bit", "torchao.optim", {}),  # --optim adamw_torch_4bit
        ("AdamWFp8", "torchao.optim", {}),
    ],
)
def test_an_optimizer_with_quantized_state_is_one_line_next_to_shards(class_name, module, attributes):
    with pytest.raises(ConfigError, match="keeps its state quantized in blocks"):
        _check(_optimizer(class_name, module, **attributes))


@pytest.mark.parametrize("class_name", ["StableAdamW", "OneBitAdam", "Lamb"])
def test_an_optimizer_reading_a_whole_tensor_is_one_line_next_to_shards(class_name):
    with pytest.raises(ConfigError, match="statistics of each whole tensor"):
        _check(_optimizer(class_name, "some_package.optim"))


def test_elementwise_and_unknown_optimizers_run():
    assert _check(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])) == []
    # bitsandbytes' 32-bit AdamW updates each element on its own (its class is named like torch's)
    assert _check(_optimizer("AdamW", "bitsandbytes.optim.adamw", args=SimpleNamespace(optim_bits=32))) == []
    said = _check(_optimizer("GrokAdamW", "grokadamw"))
    assert len(said) == 1 and "equals one process only if its update treats every element on its own" in said[0]
