"""A collective that lost its peer is named in one line; any other error keeps its traceback. A finished worker
exits without racing gloo's threads."""

import sys

import pytest
import torch

from mtk.spawn import run_distributed
from mtk.training.entry import peer_failure, run_main

CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:10125. This is typically caused by a remote worker crashing. Check the logs of the remote "
    "worker before reporting an error. GLHF!"
)


@pytest.fixture
def peers(monkeypatch):
    """A process group of 2 (gloo's lost-peer errors are plain RuntimeErrors, known by their words where there are
    peers)."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)


def test_a_process_alone_keeps_its_own_connection_errors_traceback(monkeypatch):
    """A user's download that failed with "Connection reset by peer" in a single process was blamed on a peer rank
    and lost its traceback."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert peer_failure(RuntimeError("fetching s3://b/shard-7 failed: [Errno 104] Connection reset by peer")) is None


def test_the_gist_of_a_lost_peer(peers):
    assert peer_failure(RuntimeError(CLOSED)) == "Connection closed by peer [127.0.0.1]:10125"
    timed_out = "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete"
    assert peer_failure(RuntimeError(timed_out)) == "Timed out waiting 3000ms for recv operation to complete"


def test_other_errors_keep_their_traceback():
    assert peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert peer_failure(KeyError("Timed out waiting")) is None

    def main() -> None:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        run_main(main, "train.py")


def test_a_lost_peer_is_one_line_and_status_1(capsys, peers):
    def main() -> None:
        raise RuntimeError(CLOSED)

    with pytest.raises(SystemExit) as exit_:
        run_main(main, "train.py")
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("train.py: error: a collective failed (Connection closed by peer [127.0.0.1]:10125)"), err
    assert len(err.splitlines()) == 1


def test_an_own_loops_hook_names_a_lost_peer_in_one_line(capsys, monkeypatch, peers):
    """A user's own loop (the Accelerator's excepthook): a rank that waited in one of mtk's collectives on a peer
    that raised printed a traceback through mtk's code, where the scripts say it in one line; a bug keeps its
    traceback."""
    import sys

    from mtk.training.entry import report_mtk_errors

    seen: list[BaseException] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, trace: seen.append(value))
    report_mtk_errors("loop.py")
    sys.excepthook(RuntimeError, RuntimeError(CLOSED), None)
    err = capsys.readouterr().err
    assert err.startswith("loop.py: error: a collective failed (Connection closed by peer [127.0.0.1]:10125)"), err
    assert len(err.splitlines()) == 1 and not seen
    bug = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    sys.excepthook(RuntimeError, bug, None)
    assert seen == [bug] and not capsys.readouterr().err


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to "
            "allocate 25599999999744 bytes. Error code 12 (Cannot allocate memory)"
        ),  # fmt: skip
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    ],
    ids=["cpu", "device"],
)
def test_an_allocation_that_fails_is_one_line_and_status_1(capsys, error):
    """finetune.py --lora_r 99999999999 asked the CPU allocator for 25.6 TB: one line saying what to change."""

    def main() -> None:
        raise error

    with pytest.raises(SystemExit) as exit_:
        run_main(main, "train.py")
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("train.py: error: out of memory (") and "use a smaller --batch_size" in err, err
    assert len(err.splitlines()) == 1
    with pytest.raises(SystemExit):  # each script's own names for what sets its memory
        run_main(main, "sft.py")
    assert "use a smaller --per_device_train_batch_size, --max_length or the LoRA rank" in capsys.readouterr().err


@pytest.mark.parametrize(
    "body, status, line, prog",
    [
        ("pass", 0, None, "train.py"),
        ("sys.exit('training diverged: loss nan')", 1, "training diverged: loss nan", "train.py"),
        ("pass", 0, None, "trainer_script.py"),
    ],
    ids=["finished", "sys.exit with a message", "a script that names itself otherwise"],
)
def test_a_launched_worker_leaves_with_its_status_after_the_atexit_handlers(tmp_path, body, status, line, prog):
    """A worker skips the interpreter's teardown (where gloo threads can abort it) but not what a clean exit
    does: the atexit handlers run, stdout is flushed, the status is sys.exit's."""
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import atexit, sys\n"
        "from mtk.training.entry import run_main\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "class Global:\n"
        "    def __del__(self):\n"
        "        print('teardown', flush=True)\n"
        "kept = Global()\n"
        "def main():\n"
        "    print('buffered', end='')\n"
        f"    {body}\n"
        f"run_main(main, {prog!r})\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "LOCAL_RANK": "0"},
    )
    assert done.returncode == status, done.stderr
    # an error keeps the teardown, and so does a script that names itself otherwise (code may follow run_main;
    # it waits for the groups' threads instead)
    assert done.stdout == "bufferedatexit ran\n" + ("teardown\n" if status or prog != "train.py" else "")
    assert done.stderr.strip() == (line or "")


def _groups_outlive_their_destruction(rank: int, world_size: int) -> list[int]:
    import gc
    import types

    import torch
    import torch.distributed as dist

    from mtk.parallel.state import ParallelState

    state = ParallelState.build(tp_size=1, pp_size=1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2), process_group=state.dp_group)
    model(torch.ones(1, 2)).sum().backward()
    group = state.dp_group
    dist.destroy_process_group()  # what accelerate's end_training does
    del state
    gc.collect()
    # Python owners besides this frame and the model (whose attributes go before its Reducer when it is freed): were
    # the Reducer the last owner, freeing the model would join the group's gloo threads while holding the GIL (a
    # hang as a script's main returns)
    owners = [r for r in gc.get_referrers(group) if r is not model.__dict__ and not isinstance(r, types.FrameType)]
    return [len(owners)]


def test_process_groups_outlive_ddp_after_end_training():
    assert all(owners[0] >= 1 for owners in run_distributed(_groups_outlive_their_destruction, 2))


def test_a_name_the_file_system_cannot_use_is_one_line(capsys):
    """A path too long, through a link loop, with bytes that are not UTF-8 where it must be written as text
    (tensorboard's record of a --data path), or a place that cannot be written (read-only, no permission, full): one
    line, exit status 2, wherever the script first touched it."""
    import errno

    for error, said in (
        (OSError(errno.ENAMETOOLONG, "File name too long", "a" * 300), "characters): File name too long (a name may"),
        (OSError(errno.ELOOP, "Too many levels of symbolic links", "loop/sub"), "give a path without the loop"),
        (RuntimeError("Symlink loop from '/x/loop'"), "Symlink loop from '/x/loop' (its symbolic links point back"),
        (UnicodeEncodeError("utf-8", "da\udcffta.jsonl", 2, 3, "surrogates not allowed"), "holds bytes that are not"),
        # a place that cannot be written, where a library first tried (the Trainer's, tensorboard's mkdir)
        (OSError(errno.EROFS, "Read-only file system", "/ro/out"), "/ro/out: Read-only file system (the file system"),
        (OSError(errno.EACCES, "Permission denied", "/root/x"), "/root/x: Permission denied (this user may not use"),
        (OSError(errno.ENOSPC, "No space left on device"), "a file it writes: No space left on device (the file"),
    ):

        def main(error=error) -> None:
            raise error

        with pytest.raises(SystemExit) as exit_:
            run_main(main, "train.py")
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("train.py: error: ") and said in err and len(err.splitlines()) == 1, err

    def broken_disk() -> None:
        raise OSError(errno.EIO, "I/O error", "x")

    with pytest.raises(OSError):  # any other OSError keeps its traceback
        run_main(broken_disk, "train.py")


def test_a_keyword_a_setting_passes_on_is_one_line_and_other_type_errors_are_bugs():
    """``lr_scheduler_kwargs={"bogus": 1}`` reaches the scheduler's function as a keyword it does not take: a setting,
    one line; any other ``TypeError`` inside ``library_refusals`` keeps its traceback."""
    from mtk.errors import ConfigError, library_refusals

    def schedule(warmup: int) -> None:
        return None

    with pytest.raises(ConfigError, match="got an unexpected keyword argument 'bogus'"), library_refusals():
        schedule(warmup=1, **{"bogus": 1})  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="got multiple values for argument 'warmup'"), library_refusals():
        schedule(1, **{"warmup": 3})  # type: ignore[misc]
    with pytest.raises(TypeError), library_refusals():
        len(5)  # type: ignore[arg-type]


def test_a_path_that_is_not_what_a_setting_takes_says_what_to_do(tmp_path):
    """A library opening a folder given for a file (``--deepspeed DIR``), or a path that is not there, names only
    the path: the line adds what to do about it."""
    from mtk.errors import ConfigError, library_refusals

    with pytest.raises(ConfigError, match="Is a directory.*a folder was given where a file is wanted"):
        with library_refusals():
            open(tmp_path)
    with pytest.raises(ConfigError, match="No such file or directory.*check the path"), library_refusals():
        open(tmp_path / "absent.json")


def test_an_own_loop_lets_the_groups_threads_free_the_last_collective_before_the_teardown(monkeypatch):
    """An own loop that generated at TP 2 aborted at exit in 2 of 3 launches (a core dump: a gloo worker destroying
    the last all-gather's work took the GIL in the interpreter's teardown). The Accelerator's hook waits at exit,
    the GIL released, where this process made a process group; a script that leaves through ``_leave`` skips it."""
    import atexit

    from mtk.training import entry

    registered: list = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    entry.report_mtk_errors("loop.py")
    assert entry._let_collectives_settle in registered
    slept: list[float] = []
    monkeypatch.setattr(entry.time, "sleep", slept.append)
    monkeypatch.setattr(entry, "groups_made", lambda: False)
    entry._let_collectives_settle()
    assert slept == []
    monkeypatch.setattr(entry, "groups_made", lambda: True)
    entry._let_collectives_settle()
    assert slept == [entry._SETTLE_S] and entry._SETTLE_S > 0
