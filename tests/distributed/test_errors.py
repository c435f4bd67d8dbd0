"""Bad input seen by any rank reaches the user: each distinct message once, with the rank that saw it."""

import contextlib
import io
import time

from mtk.errors import DataError, run_main
from mtk.testing import run_distributed

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
    assert err1 == "train.py: error: [rank 1] a file only rank 1 reads is damaged\n"
    assert err2 == "", "a message already reported is not repeated"
