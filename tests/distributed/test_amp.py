"""fp16 loss scaling: an overflow on one TP rank makes every model-parallel rank skip the step."""

import torch

from mtk.parallel import ParallelState
from mtk.parallel.amp import TPGradScaler
from mtk.testing import run_distributed


def _overflow_on_rank_1(rank: int, world_size: int, tp: int = 2, ep: int = 1) -> dict:
    state = ParallelState.build(tp_size=tp, ep_size=ep)
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


def test_an_overflow_in_one_ranks_experts_skips_the_step_across_its_expert_parallel_group():
    """TP 1 x EP 2 inside DP 2: rank 1's experts overflowed; rank 0, its EP peer, holds other experts and must
    skip too (its dense weights would otherwise leave rank 1's behind)."""
    for result in run_distributed(_overflow_on_rank_1, world_size=2, args=(1, 2)):
        assert result["param"] == [1.0] * 4 and result["scale"] == 512.0


def _overflow_in_a_parameter_another_rank_updates(rank: int, world_size: int) -> dict:
    from mtk.parallel.distributed_optimizer import shard_optimizer

    state = ParallelState.build(tp_size=1)
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(2)]
    optimizer = torch.optim.SGD(params, lr=0.1)
    shards = shard_optimizer(optimizer, state.replica_group)
    mine = [shards.owns(p) for p in params]
    scaler = TPGradScaler("cpu", parallel=state, init_scale=1024.0)
    scaler.scale(torch.tensor(1.0))
    params[0].grad = torch.full((4,), float("inf"))  # the same reduced gradients on both replicas
    params[1].grad = torch.full((4,), 2048.0)
    scaler.unscale_(optimizer)
    unscaled = params[1].grad.tolist()
    scaler.step(optimizer)
    scaler.update()
    return {"owns": mine, "unscaled": unscaled, "scale": scaler.get_scale()}


def test_under_the_distributed_optimizer_every_gradient_is_unscaled_and_checked():
    """DP 2 with the distributed optimizer: each rank updates one of the two parameters, the overflow is in one of
    them. Both ranks skip (the rank updating the other parameter saw no inf in its own) and both unscale every
    gradient (clipping reads them all)."""
    results = run_distributed(_overflow_in_a_parameter_another_rank_updates, world_size=2)
    assert sorted(r["owns"] for r in results) == [[False, True], [True, False]]
    for result in results:
        assert result["unscaled"] == [2.0] * 4 and result["scale"] == 512.0


def _autocast_in_a_pipeline(rank: int, world_size: int) -> dict:
    from mtk import Accelerator, ParallelConfig
    from mtk.config import RunSettings
    from mtk.models import build_model

    accelerator = Accelerator(
        mixed_precision="bf16",
        parallel_config=ParallelConfig(pp_size=2),
        run_settings=RunSettings(num_micro_batches=2),
    )
    model = accelerator.prepare(build_model("tiny-llama", seed=0))
    seen: dict[str, list[bool]] = {"forward": [], "backward": []}
    for layer in accelerator.unwrap_model(model).modules():
        if type(layer).__name__ == "LlamaDecoderLayer":
            layer.register_forward_hook(lambda *_: seen["forward"].append(torch.is_autocast_enabled("cpu")))
            layer.register_full_backward_hook(lambda *_: seen["backward"].append(torch.is_autocast_enabled("cpu")))
    ids = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(0))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    return seen


def test_a_pipelines_backward_runs_without_autocast():
    """accelerate wraps the prepared model's forward in autocast, and a pipeline's schedule backpropagates inside
    its forward: a region the model keeps in fp32 (autocast off in its forward) was backpropagated in bf16. Outside
    a pipeline the backward runs without autocast; inside one too now."""
    for seen in run_distributed(_autocast_in_a_pipeline, world_size=2):
        assert seen["forward"] and all(seen["forward"]), seen
        assert seen["backward"] and not any(seen["backward"]), seen
