"""The TP RNG streams: same default stream on every TP rank, distinct TP streams, no interference."""

import pytest
import torch

from mtk.parallel.random import TP_STREAM, RNGStreams, seed_everything_parallel


def _draws(tp_rank: int, fork_between: bool):
    streams = seed_everything_parallel(1234, tp_rank)
    first = torch.rand(4)
    tp_draw = None
    if fork_between:
        with streams.fork():
            tp_draw = torch.nn.functional.dropout(torch.ones(16), p=0.5)
    second = torch.rand(4)
    return first, tp_draw, second


def test_default_stream_shared_tp_stream_distinct():
    a_first, a_tp, a_second = _draws(tp_rank=0, fork_between=True)
    b_first, b_tp, b_second = _draws(tp_rank=1, fork_between=True)
    assert torch.equal(a_first, b_first) and torch.equal(a_second, b_second)
    assert not torch.equal(a_tp, b_tp), "dropout masks inside TP regions must differ per TP rank"


def test_fork_does_not_advance_the_default_stream():
    _, _, with_fork = _draws(tp_rank=0, fork_between=True)
    _, _, without_fork = _draws(tp_rank=0, fork_between=False)
    assert torch.equal(with_fork, without_fork)


def test_state_dict_resumes_the_stream():
    streams = seed_everything_parallel(7, tp_rank=0)
    with streams.fork():
        torch.rand(3)
    saved = streams.state_dict()
    with streams.fork():
        expected = torch.rand(5)
    restored = RNGStreams("cpu")
    restored.load_state_dict(saved)
    with restored.fork(TP_STREAM):
        assert torch.equal(torch.rand(5), expected)


def test_errors_name_the_stream():
    streams = RNGStreams("cpu")
    streams.add("a", 1)
    with pytest.raises(ValueError, match="'a' already exists"):
        streams.add("a", 2)
    with pytest.raises(KeyError, match="never added"):
        with streams.fork("b"):
            pass
