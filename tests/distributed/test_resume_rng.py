"""The generators a resume restores: each rank its own at the rank grid it was saved at; rank 0's on every rank at
another grid, so that the ranks of one replica draw the same replicated-region dropout whatever each process drew
before the save (a TP 2 x PP 2 run resumed at TP 4 gave one TP group another stage's states: it stopped at the
first step with a check that blamed the data)."""

import torch

from mtk.checkpoint.sharded import load_checkpoint, save_checkpoint
from mtk.convert import parallelize
from mtk.models import build_model
from mtk.parallel import ParallelState
from mtk.testing import run_distributed


def _resumed_generators(rank: int, world_size: int, directory: str) -> dict[str, torch.Tensor]:
    """Save at TP 1 (DP 2) with a generator per rank, then resume at TP 1 and at TP 2: the generators after each."""
    states = {}
    for tp in (1, 1, 2):  # save, then resume at the same grid and at another
        parallel = ParallelState.build(tp_size=tp)
        model = parallelize(build_model("tiny-gpt2", seed=0), parallel)
        torch.manual_seed(100 + rank)  # as set_seed(..., device_specific=True) leaves them
        if not states:
            save_checkpoint(directory, parallel, model, [], [], step=1)
            states["saved"] = torch.get_rng_state()
            continue
        load_checkpoint(directory, parallel, model, [], [])
        states[f"tp{tp}"] = torch.get_rng_state()
    return states


def test_a_resume_at_another_rank_grid_gives_every_rank_rank_zeros_generators(tmp_path):
    first, second = run_distributed(_resumed_generators, world_size=2, args=(str(tmp_path / "ckpt"),))
    assert not torch.equal(first["saved"], second["saved"])
    for rank, states in enumerate((first, second)):
        assert torch.equal(states["tp1"], states["saved"]), f"rank {rank}: its own generators at the same grid"
        assert torch.equal(states["tp2"], first["saved"]), f"rank {rank}: rank 0's generators at TP 2"
