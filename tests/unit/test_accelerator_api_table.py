"""docs/training.md's table of accelerate's Accelerator API cannot drift from the code.

Every public name of the installed ``accelerate.Accelerator`` is in the table exactly once; a name
mtk overrides is not marked *as is*, and one marked *as is* is not overridden.
"""

import re
from pathlib import Path

import accelerate

import mtk

DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"
STATUSES = {"as is", "TP-aware", "differs"}
MTK_ADDITIONS = {
    "held_elements",
    "parallelize",
    "step_windows",
}  # methods accelerate does not have, described below the table


def documented() -> dict[str, str]:
    text = DOC.read_text()
    table = text.split("<!-- accelerator-api:start -->")[1].split("<!-- accelerator-api:end -->")[0]
    rows = [line.split("|")[1:4] for line in table.strip().splitlines()[2:]]
    status: dict[str, str] = {}
    for names, mark, _ in rows:
        assert mark.strip() in STATUSES, f"unknown status {mark.strip()!r}"
        for name in re.findall(r"`([^`]+)`", names):
            assert name not in status, f"{name} is in the table twice"
            status[name] = mark.strip()
    return status


def test_every_accelerate_api_is_in_the_table():
    public = {name for name in dir(accelerate.Accelerator) if not name.startswith("_")}
    table = documented()
    assert sorted(public - set(table)) == [], "accelerate API missing from docs/training.md"
    assert sorted(set(table) - public) == [], "docs/training.md names API accelerate does not have"


def test_overrides_are_not_marked_as_is():
    overridden = {
        name
        for klass in mtk.Accelerator.__mro__
        if klass.__module__.startswith("mtk.")
        for name in vars(klass)
        if not name.startswith("_")
    }
    additions = {name for name in overridden if not hasattr(accelerate.Accelerator, name)}
    assert additions == MTK_ADDITIONS, "mtk adds public API: name it in MTK_ADDITIONS and in docs/training.md"
    assert all(f"`accelerator.{name}(" in DOC.read_text() for name in additions)
    overridden -= additions
    table = documented()
    wrongly_as_is = sorted(name for name in overridden if table.get(name) == "as is")
    assert wrongly_as_is == [], "mtk overrides these: mark them TP-aware or differs"
    assert sorted(overridden - set(table)) == [], "mtk adds public API the table does not list"
    not_overridden = {name for name, mark in table.items() if mark != "as is"} - overridden
    behaviour_elsewhere = {"save_model", "parallelism_config", "torch_device_mesh"}  # via __init__/get_state_dict
    assert sorted(not_overridden - behaviour_elsewhere) == [], "marked as changed but mtk does not override them"
