"""A damaged shard that only one TP rank reads is found by every rank: all refuse with the same line
naming the file, none is left waiting in a collective."""

import torch

from mtk.checkpoint import CheckpointError
from mtk.checkpoint.sharded import load_checkpoint, save_checkpoint
from mtk.convert import parallelize
from mtk.models import build_model
from mtk.parallel import ParallelState
from mtk.testing import run_distributed


def _save_damage_load(rank: int, world_size: int, directory: str) -> str:
    parallel = ParallelState.build(tp_size=world_size)
    model = parallelize(build_model("tiny-llama"), parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = save_checkpoint(directory, parallel, model, [optimizer], [], step=1)
    if rank == 0:
        shard = path / "model" / "tp01-pp00.safetensors"  # read by TP rank 1 only
        data = bytearray(shard.read_bytes())
        data[-3] ^= 0x01
        shard.write_bytes(bytes(data))
    torch.distributed.barrier()
    try:
        load_checkpoint(directory, parallel, model, [optimizer], [])
    except CheckpointError as err:
        return str(err)
    return "loaded"


def test_every_rank_refuses_a_shard_only_one_rank_reads(tmp_path):
    errors = run_distributed(_save_damage_load, world_size=2, args=(str(tmp_path / "step_1"),))
    assert errors[0] == errors[1], errors
    assert "model/tp01-pp00.safetensors does not match its recorded xxh3_128" in errors[0]
