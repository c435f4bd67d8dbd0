"""Bad input seen by any rank reaches the user: each distinct message once, with the rank that saw it; a peer
that hangs ends the run after the collective timeout, with one line."""

import contextlib
import io
import time
from datetime import timedelta

from mtk.errors import DataError
from mtk.testing import run_distributed
from mtk.training.entry import run_main

MESSAGES = {0: "the same problem", 1: "a file only rank 1 reads is damaged", 2: "the same problem"}


def _fail(rank: int, world_size: int) -> tuple[int, str]:
    def main() -> None:
        time.sleep(0.3 * rank)  # rank 0 first: it hosts the store here, as under the deepspeed launcher
        raise DataError(MESSAGES[rank])

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            run_main(main, "train.py")
        except SystemExit as exit_:
            return int(exit_.code), stderr.getvalue()
    return 0, stderr.getvalue()


def test_each_distinct_error_is_printed_once_by_the_rank_that_saw_it():
    (code0, err0), (code1, err1), (code2, err2) = run_distributed(_fail, world_size=3)
    assert code0 == code1 == code2 == 2
    assert err0 == "train.py: error: the same problem\n"
    # another rank starts a fresh line first: rank 0's progress bar may hold the shared stream's current line
    assert err1 == "\ntrain.py: error: [rank 1] a file only rank 1 reads is damaged\n"
    assert err2 == "", "a message already reported is not repeated"


def _hang(rank: int, world_size: int) -> tuple[int, str, float]:
    import torch
    import torch.distributed as dist

    from mtk.parallel import ParallelState
    from mtk.parallel.state import group_timeout

    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=2))  # as init_process_group(timeout=...) sets it
    parallel = ParallelState.build(tp_size=2)
    assert group_timeout(parallel.tp_group) == timedelta(seconds=2)  # mtk's groups wait as long as the world
    if rank == 1:
        time.sleep(6)  # stuck (in I/O, a deadlock, a debugger): it never joins the collective
        return 0, "", 0.0

    stderr, start = io.StringIO(), time.monotonic()
    with contextlib.redirect_stderr(stderr):
        try:
            run_main(lambda: dist.all_reduce(torch.ones(1), group=parallel.tp_group), "train.py")
        except SystemExit as exit_:
            return int(exit_.code), stderr.getvalue(), time.monotonic() - start
    return 0, stderr.getvalue(), time.monotonic() - start


def test_a_rank_that_stops_answering_ends_the_run_after_the_timeout_with_one_line():
    (code, err, seconds), _ = run_distributed(_hang, world_size=2)
    assert code == 1 and seconds < 5.5, (code, seconds)  # 2 s of waiting, then the 2 s grace for peers' reports
    assert err.startswith("train.py: error: a collective failed (Timed out waiting 2000ms for recv operation"), err
    assert "another rank exited or stopped answering" in err and "collectives wait 2 s for a peer" in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err


def _slow(rank: int, world_size: int) -> None:
    time.sleep(30)


def test_workers_past_their_time_are_said_as_time_run_out_not_as_a_hang():
    """``mtk bench --timeout 3`` blamed a collective not joined by every rank when its workers had not finished
    starting: the time allowed ran out, and the line says so first."""
    import pytest

    from mtk.spawn import DistributedTestError

    with pytest.raises(DistributedTestError, match=r"ranks \[0, 1\] still running when the 1 s allowed ran out"):
        run_distributed(_slow, world_size=2, timeout=1)
