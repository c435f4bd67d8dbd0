"""The distributed optimizer (ZeRO-1 over DP, no DeepSpeed) updates exactly as the unsharded one, holds half
the state at DP=2, and gives checkpoints the whole state in mtk's layout."""

import tempfile

import torch

from mtk.checkpoint.sharded import load_checkpoint, save_checkpoint
from mtk.convert import parallelize
from mtk.models import build_model
from mtk.parallel import ParallelState, distributed_optimizer
from mtk.parallel.distributed_optimizer import full_optimizer_state, shard_optimizer
from mtk.parallel.grads import all_reduce_coalesced
from mtk.testing import assert_close_rel, run_distributed


def _state_elements(optimizer) -> int:
    return sum(v.numel() for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


def _checks(rank: int, world_size: int, directory: str) -> dict:
    state = ParallelState.build(tp_size=2)  # tp 2 x dp 2
    model = parallelize(build_model("tiny-llama", seed=0), state)
    sharded_model = parallelize(build_model("tiny-llama", seed=0), state)
    plain = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sharded = torch.optim.AdamW(sharded_model.parameters(), lr=3e-3)
    distributed_optimizer.BUCKET_ELEMENTS = 1000  # several all-gather rounds even on the tiny model
    shards = shard_optimizer(sharded, state.dp_group)
    assert shards is not None and len(shards.domains[0].buckets[torch.float32]) > 2  # the dense domain
    generator = torch.Generator().manual_seed(10 + state.dp_rank)  # each replica its own data
    for step in range(10):
        ids = torch.randint(0, 256, (2, 16), generator=generator)
        for m, o in ((model, plain), (sharded_model, sharded)):
            m(input_ids=ids, labels=ids).loss.backward()
            all_reduce_coalesced([p.grad for p in m.parameters()], state.dp_group, average=True)
            o.step()
            o.zero_grad()
        for (name, a), b in zip(model.named_parameters(), sharded_model.parameters()):
            assert_close_rel(b, a, f"{name} after step {step + 1}")
    elements = (_state_elements(sharded), _state_elements(plain))
    save_checkpoint(directory, state, sharded_model, [sharded], [], step=10)
    assert _state_elements(sharded) == elements[0], "back to this rank's share after the save"
    restored = torch.optim.AdamW(sharded_model.parameters(), lr=3e-3)
    shard_optimizer(restored, state.dp_group)
    load_checkpoint(directory, state, sharded_model, [restored], [])
    with full_optimizer_state([restored], gather=True):
        full = restored.state_dict()
    for index, saved in plain.state_dict()["state"].items():
        for key, value in saved.items():
            assert_close_rel(full["state"][index][key], value, f"state {index} {key} after save and load")
    return {"elements": elements}


def test_sharded_adamw_equals_unsharded_and_checkpoints_whole():
    with tempfile.TemporaryDirectory() as directory:
        results = run_distributed(_checks, world_size=4, args=(directory,))
    for result in results:
        mine, everything = result["elements"]
        assert 0.3 < mine / everything < 0.7, "about half the optimizer state per replica at dp 2"
