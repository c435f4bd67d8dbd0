"""The numerics guard on the global gradient norm: stop (naming the step) or, with skip, say so and skip."""

import pytest
import torch

from mtk.errors import TrainingError
from mtk.parallel.grad_norm import check_finite


def test_finite_norm_steps():
    assert check_finite(torch.tensor(3.5), step=7) is True


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_norm_stops_or_skips(value, capsys):
    with pytest.raises(TrainingError, match=f"step 7: the gradient norm is {value}; stopped before"):
        check_finite(torch.tensor(value), step=7)
    assert check_finite(torch.tensor(value), step=7, skip=True) is False
    assert f"mtk: step 7 skipped: the gradient norm is {value}" in capsys.readouterr().out
