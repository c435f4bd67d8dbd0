"""A batch past a model's learned positions is one line in mtk's trainers (TRL's default max_length 1024 let rows
longer than a tiny GPT-2's 32 positions reach torch.embedding: an IndexError traceback on every rank)."""

from types import SimpleNamespace

import pytest
import torch

from mtk.errors import ConfigError
from mtk.models import build_model
from mtk.trainers.positions import PositionTable, check_batch_positions, learned_positions


def test_only_a_table_of_learned_positions_has_a_limit():
    gpt2 = build_model("tiny-gpt2")
    assert learned_positions(gpt2) == PositionTable(gpt2.config.n_positions, from_mask=False)
    assert learned_positions(build_model("tiny-llama")) is None  # (rotary: runs past, as one process does)
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
                       max_position_embeddings=8, word_embed_proj_dim=16)  # fmt: skip
    opt = OPTForCausalLM(config)
    assert learned_positions(opt) == PositionTable(8, from_mask=True)


def test_a_batch_past_the_table_is_one_line_and_packed_positions_count_as_given():
    args, table, cpu = SimpleNamespace(max_length=256), PositionTable(32, from_mask=False), torch.device("cpu")
    check_batch_positions({"input_ids": torch.zeros(2, 32, dtype=torch.long)}, table, args, cpu)
    said = r"reaches position 33, past the model's 32 learned positions; SimpleNamespace.max_length=256 lets rows"
    with pytest.raises(ConfigError, match=said):
        check_batch_positions({"input_ids": torch.zeros(2, 33, dtype=torch.long)}, table, args, cpu)
    packed = torch.cat([torch.arange(20), torch.arange(20)])[None]  # (a padding-free row of two examples)
    row = {"input_ids": torch.zeros(1, 40, dtype=torch.long), "position_ids": packed}
    check_batch_positions(row, table, args, cpu)
    check_batch_positions({"input_ids": torch.zeros(2, 99, dtype=torch.long)}, None, args, cpu)  # (no table)
    check_batch_positions([torch.zeros(2, 99)], table, args, cpu)  # (a collator's own batch type: nothing to tell)
    with pytest.raises(ConfigError, match="; truncate the rows your data or collator builds to at most 32 tokens$"):
        check_batch_positions({"input_ids": torch.zeros(2, 33, dtype=torch.long)}, table, None, cpu)  # (Trainer's)
    # OPT's positions count the attended tokens: a batch padded past the table runs in one process
    mask = torch.zeros(2, 40, dtype=torch.long)
    mask[:, :30] = 1
    padded = {"input_ids": torch.zeros(2, 40, dtype=torch.long), "attention_mask": mask}
    check_batch_positions(padded, PositionTable(32, from_mask=True), args, cpu)
    with pytest.raises(ConfigError, match="reaches position 40"):
        check_batch_positions(padded, table, args, cpu)


def _replicas_with_other_lengths(rank: int, world_size: int) -> str:
    length = 40 if rank == 1 else 10  # (data-parallel replicas draw other batches: one long row on rank 1 only)
    try:
        check_batch_positions(
            {"input_ids": torch.zeros(1, length, dtype=torch.long)}, PositionTable(32, from_mask=False), None,
            torch.device("cpu"),
        )  # fmt: skip
    except ConfigError as err:
        return str(err)
    return "ran"


def test_every_rank_refuses_the_batch_any_rank_holds():
    """A refusal on the rank that held the long row alone left the others in the gradient's all-reduce."""
    from mtk.testing import run_distributed

    said = run_distributed(_replicas_with_other_lengths, world_size=2)
    assert all(line.startswith("a batch reaches position 40, past the model's 32") for line in said), said
