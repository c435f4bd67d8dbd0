"""A batch past a model's learned positions is one line in mtk's trainers (TRL's default max_length 1024 let rows
longer than a tiny GPT-2's 32 positions reach torch.embedding: an IndexError traceback on every rank)."""

from types import SimpleNamespace

import pytest
import torch

from mtk.errors import ConfigError
from mtk.models import build_model
from mtk.trainers.positions import check_batch_positions, learned_position_limit


def test_only_a_table_of_learned_positions_has_a_limit():
    gpt2 = build_model("tiny-gpt2")
    assert learned_position_limit(gpt2) == gpt2.config.n_positions
    assert learned_position_limit(build_model("tiny-llama")) is None  # (rotary: runs past, as one process does)


def test_a_batch_past_the_table_is_one_line_and_packed_positions_count_as_given():
    args = SimpleNamespace(max_length=256)
    check_batch_positions({"input_ids": torch.zeros(2, 32, dtype=torch.long)}, 32, args)
    with pytest.raises(ConfigError, match=r"reaches position 33, past the model's 32 learned positions \(Simple"):
        check_batch_positions({"input_ids": torch.zeros(2, 33, dtype=torch.long)}, 32, args)
    packed = torch.cat([torch.arange(20), torch.arange(20)])[None]  # (a padding-free row of two examples)
    check_batch_positions({"input_ids": torch.zeros(1, 40, dtype=torch.long), "position_ids": packed}, 32, args)
    check_batch_positions({"input_ids": torch.zeros(2, 99, dtype=torch.long)}, None, args)  # (no table)
