"""The YAML ``accelerate launch`` read, and the ``megatron_lm_config`` keys in it that accelerate drops.

accelerate turns each ``megatron_lm_config`` key it knows into a ``MEGATRON_LM_*`` variable and drops any other
without a word (a misspelt ``megatron_lm_sequence_paralellism: true`` simply never arrives). It exports no
variable naming the config file either, so mtk reads the launcher's own command line: the processes that
``accelerate launch`` starts are its descendants (through torchrun's agent), and Linux shows each ancestor's
arguments and working directory under ``/proc``. Where that is not available (another OS, another launcher),
nothing is found and the environment check alone applies.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from accelerate.commands.config import default_config_file
from accelerate.commands.launch import launch_command_parser

from mtk.errors import ConfigError

__all__ = ["accelerate_megatron_keys", "check_launcher_keys", "config_file_from_argv", "launcher_config_file"]

_ANCESTORS = 8  # this process <- torchrun's agent <- accelerate launch (and a shell or SLURM's step between)


def accelerate_megatron_keys() -> list[str]:
    """Every ``megatron_lm_*`` key the installed accelerate's launcher knows."""
    return sorted(a.dest for a in launch_command_parser()._actions if a.dest.startswith("megatron_lm_"))


def config_file_from_argv(argv: Sequence[str], cwd: Path) -> Path | None:
    """The config file of an ``accelerate launch`` command line (its default when none is given), or ``None``
    when ``argv`` is not ``accelerate launch``."""
    launch = next((i for i, arg in enumerate(argv) if arg == "launch" and i and "accelerate" in argv[i - 1]), None)
    if launch is None:
        return None
    options = argv[launch + 1 :]
    for i, arg in enumerate(options):
        for flag in ("--config_file", "--config-file"):
            if arg == flag and i + 1 < len(options):
                return cwd / options[i + 1]
            if arg.startswith(flag + "="):
                return cwd / arg.split("=", 1)[1]
        if not arg.startswith("-") and arg.endswith(".py"):  # the script: its own arguments follow
            break
    return Path(default_config_file)


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state; the name may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def launcher_config_file() -> Path | None:
    """The YAML of the ``accelerate launch`` this process descends from, if it can be seen and exists."""
    pid: int | None = os.getppid()
    for _ in range(_ANCESTORS):
        if not pid or pid <= 1:
            return None
        try:
            argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
            cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
        except OSError:
            return None
        found = config_file_from_argv(argv, cwd)
        if found is not None:
            return found if found.is_file() else None
        pid = _parent(pid)
    return None


def check_launcher_keys(config_file: Path | None, known: Sequence[str] | None = None) -> None:
    """Refuse (one line) a ``megatron_lm_config`` key accelerate does not know, naming the closest one it does."""
    if config_file is None:
        return
    try:
        record: Any = yaml.safe_load(config_file.read_text())
    except (OSError, yaml.YAMLError):
        return  # accelerate read it a moment ago; if it is gone or changed, its own reading stands
    block = record.get("megatron_lm_config") if isinstance(record, dict) else None
    if not isinstance(block, dict):
        return
    kind = str(record.get("distributed_type", ""))
    if block and kind.upper() != "MEGATRON_LM":  # accelerate exports the block only for MEGATRON_LM
        raise ConfigError(
            f"{config_file}: a megatron_lm_config block with distributed_type {kind or 'unset'}, which makes "
            "accelerate drop the block without a word; set distributed_type: MEGATRON_LM, or remove the block"
        )
    known = list(known if known is not None else accelerate_megatron_keys())
    for key in block:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]}?" if close else f"accelerate knows: {', '.join(known)}"
            raise ConfigError(
                f"{config_file}: megatron_lm_config key {key!r} is unknown to accelerate, which drops it without a "
                f"word; {hint}"
            )
