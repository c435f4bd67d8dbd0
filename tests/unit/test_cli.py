"""The ``mtk`` console script, run as a user types it."""

import json
import subprocess
import sys


def _mtk(*args):
    return subprocess.run([sys.executable, "-m", "mtk.cli.main", *args], capture_output=True, text=True)


def test_help_lists_subcommands():
    out = _mtk("--help")
    assert out.returncode == 0
    assert "topology" in out.stdout


def test_topology_json_matches_layout():
    out = _mtk("topology", "--world", "16", "--tp", "2", "--pp", "4", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["dp"] == 2
    assert data["groups"]["pp"][0] == [0, 4, 8, 12]
    assert "cp" not in data["groups"]  # without context parallelism, no CP or replica groups to show
    out = _mtk("topology", "--world", "16", "--tp", "2", "--cp", "2", "--pp", "2", "--json")
    data = json.loads(out.stdout)
    assert (data["cp"], data["dp"]) == (2, 2)
    assert data["groups"]["cp"][0] == [0, 2] and data["groups"]["replica"][0] == [0, 2, 4, 6]
    assert "ep" not in data["groups"]
    out = _mtk("topology", "--world", "16", "--tp", "2", "--cp", "2", "--ep", "4", "--json")
    data = json.loads(out.stdout)
    assert data["ep"] == 4 and data["groups"]["ep"][0] == [0, 2, 4, 6]
    assert data["groups"]["expert_replica"][0] == [0, 8]


def test_topology_bad_input_is_one_line_and_nonzero():
    out = _mtk("topology", "--world", "6", "--tp", "4")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0
    assert "not divisible by tp*pp" in out.stderr
    assert "Traceback" not in out.stderr


def test_an_interrupt_closes_the_progress_bars_before_its_line(capsys, monkeypatch):
    """A Ctrl-C while a bar is drawn (the export's, transformers' loading): the bar is closed first, so the interrupt's
    line is a line of its own, not the end of the bar's (``\\r`` splits lines too)."""
    from tqdm import tqdm

    import mtk.cli.main as cli

    bars = []  # held, as the command's frame holds its bar when the interrupt lands

    def interrupted(argv):
        bars.append(tqdm(total=2, desc="export"))
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_main", interrupted)
    assert cli.main([]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == cli.INTERRUPTED


def test_a_ctrl_c_python_could_not_raise_is_delivered_again_not_printed(capsys):
    """A SIGINT that lands in a weakref callback (a thread pool collected as an export ends) was printed as
    "Exception ignored ... Traceback ... KeyboardInterrupt" and lost: the command went on and exited 0."""
    import sys
    import time
    from types import SimpleNamespace

    import pytest

    from mtk.cli.main import _interrupt_again

    printed = []
    unraisable = SimpleNamespace(exc_type=KeyboardInterrupt, exc_value=KeyboardInterrupt(), object=None)
    with pytest.raises(KeyboardInterrupt):
        _interrupt_again(printed.append, unraisable)
        for _ in range(100):  # (the interrupt arrives in the main thread at its next check)
            time.sleep(0.01)
    assert printed == []
    other = SimpleNamespace(exc_type=ValueError, exc_value=ValueError("x"), object=None)
    _interrupt_again(printed.append, other)
    assert printed == [other] and sys.unraisablehook is not _interrupt_again
