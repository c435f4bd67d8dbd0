"""The default pipeline split weighs the LM head (mtk.pipeline.balance), without processes."""

import itertools

import pytest
import torch

from mtk.convert import parallelize
from mtk.models import auto_class_for, builtin_config, resolve_config
from mtk.parallel.record import parallelized
from mtk.parallel.state import ParallelState
from mtk.pipeline.balance import head_layers, head_weight, layer_counts, rank_layers, stage_layer_counts
from mtk.planner.trace import fake_process_group
from mtk.rules import UnsupportedModelError

BENCH_LLAMA_8 = "examples/configs/bench-llama-8-layers/config.json"


def _time(counts: list[int], head: int) -> int:
    """The slowest stage, in decoder layers of work: the last one also runs the head."""
    return max(counts[:-1] + [counts[-1] + head])


def test_the_head_counts_as_layers_of_the_last_stage():
    assert stage_layer_counts(4, 2, head_layers=1) == [3, 1]
    assert stage_layer_counts(8, 2, head_layers=1) == [5, 3]
    assert stage_layer_counts(12, 4, head_layers=3) == [4, 4, 3, 1]
    assert stage_layer_counts(8, 4, head_layers=1) == [3, 2, 2, 1]  # pp 2 x 2 chunks: the model's last chunk
    assert stage_layer_counts(4, 4, head_layers=2) == [1, 1, 1, 1], "never a stage without a layer"
    assert stage_layer_counts(6, 1, head_layers=5) == [6]


@pytest.mark.parametrize("layers", range(1, 11))
def test_the_default_split_is_the_fastest_whole_layer_split(layers):
    """Brute force: no split of whole layers (each stage at least one) has a faster slowest stage."""
    for stages, head in itertools.product(range(1, min(layers, 4) + 1), range(5)):
        counts = stage_layer_counts(layers, stages, head_layers=head)
        assert sum(counts) == layers and min(counts) >= 1
        splits = (s for s in itertools.product(range(1, layers + 1), repeat=stages) if sum(s) == layers)
        assert _time(counts, head) == min(_time(list(s), head) for s in splits)
        if head == 0:  # as even as possible, earlier stages take the remainder
            base, extra = divmod(layers, stages)
            assert counts == [base + (k < extra) for k in range(stages)]


def test_a_split_given_is_used_as_given():
    assert stage_layer_counts(4, 2, (2, 2), head_layers=1) == [2, 2]
    assert layer_counts(resolve_config("bench-llama"), 2, (2, 2)) == [2, 2]
    with pytest.raises(UnsupportedModelError, match="summing to the model's 4 layers"):
        stage_layer_counts(4, 2, (2, 1), head_layers=1)
    with pytest.raises(UnsupportedModelError, match="fewer than the 4 pipeline stages"):
        stage_layer_counts(2, 4, head_layers=1)


def test_head_weight_is_its_matmul_against_a_decoder_layers():
    """bench-llama: q, k, v, o (512 x 512, 256, 256, 512) and a gated MLP (3 x 512 x 1376) per layer; the head
    8192 x 512 is 1.45 of them, one whole layer: PP 2 splits 3 + 1, the hand-balanced split of docs/bench.md."""
    config = resolve_config("bench-llama")
    layer = 512 * (512 + 256 + 256 + 512) + 3 * 512 * 1376
    assert head_weight(config) == pytest.approx(8192 * 512 / layer)
    assert head_layers(config) == 1
    assert layer_counts(config, 2) == [3, 1]
    assert layer_counts(config, 4) == [1, 1, 1, 1]


def test_gpt2_layers_count_their_conv1d_matrices_not_the_position_embedding():
    config = builtin_config("tiny-gpt2")  # c_attn 64 x 192, c_proj 64 x 64, c_fc 64 x 256, c_proj 256 x 64
    assert head_weight(config) == pytest.approx(259 * 64 / (64 * 192 + 64 * 64 + 2 * 64 * 256))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-gpt2", "tiny-phi3", BENCH_LLAMA_8])
def test_small_vocabularies_keep_the_even_split(name):
    """A head under half a layer (259 tokens x hidden 64; 2048 x 512 against bench-llama's layer) weighs nothing."""
    config = resolve_config(name)
    assert head_layers(config) == 0
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    assert layer_counts(config, 2) == stage_layer_counts(layers, 2)


def test_a_tiny_model_with_a_larger_vocabulary_still_splits_sensibly():
    config = builtin_config("tiny-llama")
    config.num_hidden_layers, config.vocab_size = 4, 1000  # head: 1000 x 64 against 36864: 1.7 layers
    assert head_layers(config) == 2
    assert layer_counts(config, 2) == [3, 1]
    assert layer_counts(config, 4) == [1, 1, 1, 1]
    assert rank_layers(layer_counts(config, 4), 2) == [2, 2], "pp 2 x 2 chunks: one layer each"


def test_interleaved_ranks_hold_their_chunks():
    assert rank_layers([3, 2, 2, 1], 2) == [5, 3]
    assert rank_layers([2, 2], 2) == [2, 2]
    assert rank_layers([4], 1) == [4]


@pytest.mark.parametrize("virtual", [1, 2])
def test_the_runtime_cuts_where_the_planner_predicts(virtual):
    """``split_stages`` (what a run does, here on the meta device in a fake group of 2 ranks) holds the layers
    :func:`layer_counts` gives: bench-llama's 3 + 1 at PP 2; with 2 chunks per rank, 4 layers split 1 each."""
    config = resolve_config("bench-llama")
    counts = layer_counts(config, 2 * virtual)
    assert counts == ([3, 1] if virtual == 1 else [1, 1, 1, 1])
    for rank in range(2):
        with fake_process_group(2, rank=rank):
            with torch.device("meta"):
                model = auto_class_for(config).from_config(config)
            parallelize(model, ParallelState.build(pp_size=2, device=torch.device("cpu")), virtual_stages=virtual)
            stage = parallelized(model).stage
        starts = [sum(counts[:k]) for k in range(len(counts))]
        assert stage.chunks == tuple(range(starts[k], starts[k] + counts[k]) for k in range(rank, 2 * virtual, 2))
