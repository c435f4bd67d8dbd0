"""The YAML ``accelerate launch`` read, and the ``megatron_lm_config``, ``parallelism_config`` and ``fsdp_config``
keys in it that accelerate drops.

accelerate copies each key of those blocks onto its parsed arguments and turns the ones it knows into
``MEGATRON_LM_*``, ``PARALLELISM_CONFIG_*`` or ``FSDP_*`` variables; any other is dropped without a word (a misspelt
``megatron_lm_sequence_paralellism: true`` or ``parallelism_config_tp_szie: 2`` simply never arrives). It exports no
variable naming the config file either, so mtk reads the launcher's own command line: the processes that
``accelerate launch`` starts are its descendants (through torchrun's agent), and Linux shows each ancestor's
arguments and working directory under ``/proc``. Where that is not available (another OS, another launcher),
nothing is found and the environment check alone applies.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from accelerate.commands.config import default_config_file
from accelerate.commands.launch import launch_command_parser

from mtk.errors import ConfigError

__all__ = [
    "accelerate_block_keys",
    "accelerate_megatron_keys",
    "check_launcher_blocks",
    "check_launcher_keys",
    "config_file_from_argv",
    "launcher_config_file",
]

_ANCESTORS = 8  # this process <- torchrun's agent <- accelerate launch (and a shell or SLURM's step between)

# The YAML blocks whose keys ``accelerate launch`` copies onto its arguments as they are (fsdp_config's with "fsdp_"
# put in front of a key without it), and the prefix its options for them share.
BLOCK_PREFIXES = {"parallelism_config": "parallelism_config_", "fsdp_config": "fsdp_"}


def accelerate_megatron_keys() -> list[str]:
    """Every ``megatron_lm_*`` key the installed accelerate's launcher knows."""
    return sorted(a.dest for a in launch_command_parser()._actions if a.dest.startswith("megatron_lm_"))


def accelerate_block_keys(block: str) -> list[str] | None:
    """Every key of the YAML's ``block`` (``parallelism_config``, ``fsdp_config``) the installed accelerate passes on:
    its launcher's options of the block's prefix, and the names its environment builder
    (``accelerate.utils.launch``) reads off the arguments without an option (``fsdp_ignored_modules``, which only
    the YAML can give). ``None`` when that source cannot be read (a byte-compiled install): refusing a key the
    builder might read would be worse than saying nothing."""
    from accelerate.utils import launch as environment_builder

    prefix = BLOCK_PREFIXES[block]
    try:
        source = inspect.getsource(environment_builder)
    except (OSError, TypeError):
        return None
    pattern = rf"""args\.({prefix}\w+)|(?:get|has)attr\(\s*args\s*,\s*["']({prefix}\w+)["']"""
    read = {name for match in re.findall(pattern, source) for name in match if name}
    options = {a.dest for a in launch_command_parser()._actions if a.dest.startswith(prefix)}
    return sorted(options | read)


def _starts_launch(argv: Sequence[str], i: int) -> bool:
    """Whether ``argv[i]`` is where accelerate's launcher begins reading its options, however it was started:
    ``accelerate launch``, ``python -m accelerate.commands.launch``, or the ``accelerate-launch`` entry point."""
    arg = argv[i]
    if arg == "launch":
        return i > 0 and "accelerate" in argv[i - 1]
    if arg == "accelerate.commands.launch":
        return i > 0 and argv[i - 1] == "-m"
    return Path(arg).name == "accelerate-launch"


def config_file_from_argv(argv: Sequence[str], cwd: Path) -> Path | None:
    """The config file of an ``accelerate launch`` command line (its default when none is given), or ``None``
    when ``argv`` is not ``accelerate launch``."""
    launch = next((i for i, arg in enumerate(argv) if _starts_launch(argv, i)), None)
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


def _read_record(config_file: Path | None) -> dict[Any, Any] | None:
    """The launcher's YAML as a mapping; ``None`` when there is none to read."""
    if config_file is None:
        return None
    try:
        record: Any = yaml.safe_load(config_file.read_text())
    except (OSError, yaml.YAMLError):
        return None  # accelerate read it a moment ago; if it is gone or changed, its own reading stands
    return record if isinstance(record, dict) else None


def check_launcher_blocks(config_file: Path | None, known: Mapping[str, Sequence[str]] | None = None) -> None:
    """Refuse (one line) a ``parallelism_config`` or ``fsdp_config`` key accelerate does not pass on, naming the
    closest one it does: ``parallelism_config_tp_szie: 2`` (or ``tp_size: 2``, without the prefix accelerate's keys
    carry) would otherwise train at accelerate's default without a word."""
    record = _read_record(config_file)
    if record is None or str(record.get("compute_environment", "LOCAL_MACHINE")) != "LOCAL_MACHINE":
        return  # accelerate copies the blocks onto its arguments on a local machine only
    for block, prefix in BLOCK_PREFIXES.items():
        given = record.get(block)
        if not isinstance(given, dict):
            continue
        names = known[block] if known is not None else accelerate_block_keys(block)
        if names is None:
            continue
        for key in given:
            name = str(key)
            if block == "fsdp_config" and not name.startswith("fsdp"):
                name = "fsdp_" + name  # as accelerate reads fsdp_config's keys
            if name in names:
                continue
            short = {n.removeprefix(prefix): n for n in names}  # compared without the prefix they all share
            close = difflib.get_close_matches(name.removeprefix(prefix), list(short), n=1)
            hint = f"did you mean {short[close[0]]}?" if close else f"accelerate knows: {', '.join(names)}"
            raise ConfigError(
                f"{config_file}: {block} key {key!r} is unknown to accelerate, which drops it without a word; {hint}"
            )


def check_launcher_keys(config_file: Path | None, known: Sequence[str] | None = None) -> None:
    """Refuse (one line) a ``megatron_lm_config`` key accelerate does not know, naming the closest one it does."""
    record = _read_record(config_file)
    if record is None:
        return
    block = record.get("megatron_lm_config")
    if not isinstance(block, dict):
        return
    kind = str(record.get("distributed_type", ""))
    if block and kind.upper() != "MEGATRON_LM":  # accelerate exports the block only for MEGATRON_LM
        raise ConfigError(
            f"{config_file}: a megatron_lm_config block with distributed_type {kind or 'unset'}, which makes "
            "accelerate drop the block without a word; set distributed_type: MEGATRON_LM, or remove the block (under "
            'DEEPSPEED the TP, CP and EP sizes go in the DeepSpeed JSON\'s "mtk" block)'
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
