"""Exit signals (one request delivered twice is one; a later second one stops at once), evaluation cut short by
one, and the lock that keeps two runs out of one --output_dir."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

from mtk.checkpoint.lock import LOCK_NAME, lock_output_dir, unlock_output_dir
from mtk.checkpoint.resume import start_point
from mtk.errors import CheckpointError
from mtk.training.evaluation import evaluate

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(code: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT, "RANK": "0"}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, **kwargs,
    )  # fmt: skip


_WAITS_FOR_SIGNALS = """
    import sys, time
    from mtk.training.signals import ExitSignal
    exit_signal = ExitSignal()
    print("ready", flush=True)
    deadline = time.monotonic() + 30
    while not exit_signal.received and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(float(sys.argv[1]))  # every signal of the test has arrived
    print(f"requested {exit_signal.requested()} by {exit_signal.name}", flush=True)
"""


def _signalled(gaps: list[float], signals: list[int]) -> subprocess.CompletedProcess:
    """A process with an ExitSignal receives ``signals`` (the first at once, each next after its gap)."""
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_WAITS_FOR_SIGNALS), str(sum(gaps) + 1.0)],
        env={**os.environ, "PYTHONPATH": ROOT, "RANK": "0"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout.readline() == "ready\n"
    for gap, sig in zip([0.0, *gaps], signals):
        time.sleep(gap)
        process.send_signal(sig)
    out, err = process.communicate(timeout=60)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def test_one_request_delivered_twice_is_one_request():
    """The scheduler's SIGTERM and the launcher's forward of it, or SIGINT from a terminal and from torchrun; a
    closed terminal's SIGHUP is the same request (its default action killed the run unsaved)."""
    pairs = [[signal.SIGTERM] * 2, [signal.SIGINT] * 2, [signal.SIGINT, signal.SIGTERM], [signal.SIGHUP] * 2]
    for signals in pairs:
        done = _signalled([0.05], signals)
        name = signal.Signals(signals[0]).name
        assert done.returncode == 0 and f"requested True by {name}" in done.stdout, done
        assert "Traceback" not in done.stderr and "again" not in done.stderr


_BLOCKED_IN_C = """
    import ctypes, signal, time
    from mtk.training.signals import ExitSignal
    exit_signal = ExitSignal()
    signal.siginterrupt(signal.SIGINT, False)  # a read in C stays blocked through a signal (SA_RESTART)
    print("ready", flush=True)
    while not exit_signal.received:
        time.sleep(0.01)
    print("blocked", flush=True)
    ctypes.CDLL(None).read(0, ctypes.create_string_buffer(1), 1)  # no Python handler runs until it returns
    time.sleep(0.5)
    print(f"requested {exit_signal.requested()} by {exit_signal.name}", flush=True)
"""


def test_a_duplicate_whose_handler_runs_late_is_still_a_duplicate():
    """The main thread waits in C (a collective for a slow rank) when the launcher's forward arrives: Python runs
    that handler seconds later, but the signal arrived 0.2 s after the first, so it is the same request."""
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_BLOCKED_IN_C)], env={**os.environ, "PYTHONPATH": ROOT, "RANK": "0"},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout.readline() == "ready\n"
    process.send_signal(signal.SIGINT)
    assert process.stdout.readline() == "blocked\n"
    time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    time.sleep(2.0)  # the main thread is still in C: its handler for the second signal has not run
    out, err = process.communicate("x", timeout=60)
    assert process.returncode == 0 and out == "requested True by SIGINT\n" and err == "", (out, err)


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_request_stops_at_once_in_one_line(second):
    """A second Ctrl-C (torchrun turns a second one to the launcher into SIGTERM to its workers)."""
    done = _signalled([1.5], [signal.SIGINT, second])
    assert done.returncode == -second, done  # died of that signal, as an interrupted program does
    assert "requested" not in done.stdout and "Traceback" not in done.stderr, done
    again = "SIGINT again" if second == signal.SIGINT else "SIGTERM after SIGINT"
    assert (
        done.stderr
        == f"mtk: {again}: stopped at once, without saving; --resume auto continues from the newest checkpoint\n"
    )


class _Summing(nn.Module):
    def forward(self, input_ids, labels, **kwargs):
        return type("Out", (), {"loss": labels.float().sum()})()


def test_evaluation_stops_after_the_batch_a_signal_arrives_in():
    batches = [{"input_ids": torch.ones(1, 3, dtype=torch.long), "labels": torch.ones(1, 3, dtype=torch.long)}] * 5
    asked = []

    def stop() -> bool:
        asked.append(len(asked))
        return len(asked) == 2

    model = _Summing().train()
    assert evaluate(model, batches, torch.device("cpu"), lambda t: t, stop=stop) is None
    assert asked == [0, 1] and model.training  # stopped after the second batch; back in training mode
    scores = evaluate(model, batches, torch.device("cpu"), lambda t: t, stop=lambda: False)
    assert scores is not None and scores["eval/tokens"] == 10.0  # (the first label of each row is not predicted)


_HOLDS_THE_LOCK = """
    import sys, time
    from mtk.checkpoint.lock import lock_output_dir
    lock_output_dir(sys.argv[1])
    print("locked", flush=True)
    time.sleep(60)
"""


def test_a_second_run_in_one_output_dir_is_refused_naming_the_first(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_HOLDS_THE_LOCK), str(tmp_path)],
        env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(
            CheckpointError, match=rf"--output_dir {tmp_path} is in use by another run \(pid {holder.pid} on host "
        ):
            lock_output_dir(tmp_path)
    finally:
        holder.kill()  # SIGKILL: the kernel releases its lock; nothing is left to clean up
        holder.wait()
    assert lock_output_dir(tmp_path) is True
    assert lock_output_dir(tmp_path) is True  # this process holds it already
    assert f"pid {os.getpid()} on host" in (tmp_path / LOCK_NAME).read_text()
    unlock_output_dir(tmp_path)


def test_a_lock_file_that_is_a_link_or_a_fifo_is_refused_and_nothing_written_through_it(tmp_path):
    users = tmp_path / "users_file"
    users.write_text("the user's words")
    for name, make in (("link", lambda p: p.symlink_to(users)), ("fifo", os.mkfifo)):
        out = tmp_path / name
        out.mkdir()
        make(out / LOCK_NAME)
        with pytest.raises(CheckpointError, match=f"its lock file {LOCK_NAME} is (a symbolic link|not a regular)"):
            lock_output_dir(out)
    assert users.read_text() == "the user's words"


def test_start_point_locks_before_anything_else(tmp_path):
    class Args:
        output_dir, resume, overwrite = str(tmp_path / "new"), "auto", False

    assert start_point(Args(), main_process=True) is None
    assert (tmp_path / "new" / LOCK_NAME).is_file()
    other = _python(
        f"""
        from mtk.checkpoint.resume import start_point
        class Args:
            output_dir, resume, overwrite = {Args.output_dir!r}, "auto", False
        start_point(Args(), main_process=True)
        """
    )
    _, err = other.communicate(timeout=60)
    assert other.returncode == 1 and f"is in use by another run (pid {os.getpid()} on host" in err
    unlock_output_dir(Args.output_dir)


def test_a_ctrl_c_during_start_up_is_one_line_and_status_130(capsys, monkeypatch):
    """Before the script's ExitSignal is installed, Ctrl-C raises KeyboardInterrupt: no traceback for it."""
    from mtk.training.entry import run_main

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as stopped:
        run_main(interrupted, "finetune.py")
    assert stopped.value.code == 130
    assert capsys.readouterr().err == "finetune.py: interrupted (SIGINT); stopped without saving\n"


def test_an_ignored_signal_stays_ignored_and_restore_gives_every_handler_back():
    """Under ``nohup`` SIGHUP is ignored: ExitSignal leaves it so (a logout then does not stop the run), and
    ``restore()`` (the Trainer's ``train()`` returning) gives the other signals their handlers back; outside a
    launcher no parent-death signal is asked for."""
    code = """
        import ctypes, signal
        from mtk.training.signals import ExitSignal
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        exit_signal = ExitSignal()
        hup, term = signal.getsignal(signal.SIGHUP), signal.getsignal(signal.SIGTERM)
        during = (hup is signal.SIG_IGN, term is signal.SIG_DFL)
        death = ctypes.c_int(-1)
        ctypes.CDLL(None).prctl(2, ctypes.byref(death))  # PR_GET_PDEATHSIG
        exit_signal.restore()
        after = (signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, signal.getsignal(signal.SIGINT))
        print(during, death.value, after[0], after[1] is signal.default_int_handler, flush=True)
    """
    out, err = _python(code).communicate(timeout=60)
    assert out.strip() == "(True, False) 0 True True", (out, err)


_LATE_DUPLICATE = """
    import atexit, os, signal, sys, time
    from mtk.training.signals import ExitSignal

    def finalization_then_duplicate():  # (registered first: runs after ExitSignal's own exit hook)
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what CPython's finalization does to a Python handler
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's forward of the request, arriving late
        time.sleep(0.2)
        print("ended", flush=True)

    atexit.register(finalization_then_duplicate)
    exit_signal = ExitSignal()
    if sys.argv[1] == "asked":
        os.kill(os.getpid(), signal.SIGTERM)
        while not exit_signal.received:
            time.sleep(0.01)
"""


@pytest.mark.parametrize("asked", ["asked", "not asked"])
def test_a_duplicate_arriving_while_the_process_ends_does_not_kill_it(asked):
    """A run stopped by SIGTERM saved and is ending with status 0 when the request's second delivery arrives
    (0.2 s later: the save took less): Python's finalization had put the default action back and the process died
    with 143. After a request the signals are ignored while the process ends; without one they act as before."""
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_LATE_DUPLICATE), asked],
        env={**os.environ, "PYTHONPATH": ROOT, "RANK": "0"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    out, err = process.communicate(timeout=60)
    if asked == "asked":
        assert process.returncode == 0 and out == "ended\n" and err == "", (process.returncode, out, err)
    else:
        assert process.returncode == -signal.SIGTERM and out == "", (process.returncode, out, err)
