"""fp16 loss scaling: an overflow on one TP rank makes every model-parallel rank skip the step."""

import torch

from mtk.parallel import ParallelState
from mtk.parallel.amp import TPGradScaler
from mtk.testing import run_distributed


def _overflow_on_rank_1(rank: int, world_size: int) -> dict:
    state = ParallelState.build(tp_size=world_size)
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = TPGradScaler("cpu", parallel=state, init_scale=1024.0)
    scaler.scale(torch.tensor(1.0))  # initializes the scale
    param.grad = torch.full((4,), float("inf") if rank == 1 else 1.0)
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    return {"param": param.detach().tolist(), "scale": scaler.get_scale()}


def test_every_rank_skips_when_one_overflows():
    for result in run_distributed(_overflow_on_rank_1, world_size=2):
        assert result["param"] == [1.0] * 4, "step skipped on every rank, including the one without inf"
        assert result["scale"] == 512.0, "scale backed off identically"
