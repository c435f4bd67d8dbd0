"""A checkpoint's ``metadata.json`` as a typed, versioned record: :class:`CheckpointMeta`.

It records the topology that wrote the checkpoint (so a resume can reshard), the library versions,
the model (class, rules, config: enough for ``mtk export``), the data position, which engine wrote it,
the run that wrote it, and every other file's size and checksum (:mod:`~mtk.checkpoint.integrity`).
It is written last: a directory without it is not a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtk import jsonio
from mtk.checkpoint.atomic import holds_checkpoint
from mtk.checkpoint.paths import CheckpointPaths
from mtk.errors import CheckpointError, LayoutError
from mtk.parallel.layout import Layout

__all__ = ["FIRST_FORMAT", "FORMAT", "RUN_ID", "CheckpointMeta", "read_metadata"]

FORMAT = "mtk-checkpoint/2"
FIRST_FORMAT = "mtk-checkpoint/1"  # the same layout, without run identity and checksums
_READABLE = (FIRST_FORMAT, FORMAT)

# This process's run: rank 0's is recorded in every checkpoint it writes (a fresh id per launch).
RUN_ID = uuid.uuid4().hex


def _layout_record(layout: Layout) -> dict[str, int]:
    """The layout as ``metadata.json`` spells it (the format's keys, older than the ``*_size`` names)."""
    record = {"world": layout.world_size, "tp": layout.tp_size, "pp": layout.pp_size, "dp": layout.dp_size}
    record |= {"cp": layout.cp_size} if layout.cp_size > 1 else {}  # older readers know no "cp"
    record |= {"ep": layout.ep_size} if layout.ep_size > 1 else {}  # nor "ep"
    return record | ({"etp": 1} if layout.etp_size == 1 and layout.tp_size > 1 else {})  # nor "etp"


def _layout_from_record(record: dict[str, int]) -> Layout:
    cp, ep, etp = record.get("cp", 1), record.get("ep", 1), record.get("etp")
    layout = Layout(
        world_size=record["world"], tp_size=record["tp"], pp_size=record["pp"], cp_size=cp, ep_size=ep, etp_size=etp
    )
    if layout.dp_size != record["dp"]:
        raise ValueError(f"topology {record} is not a rank grid: world / (tp * cp * pp) != dp")
    return layout


def _check_types(values: dict[str, Any]) -> None:
    """The fields every reader uses, typed as mtk writes them: the metadata is data from disk (possibly crafted),
    and a wrong type would otherwise fail later, deep in a reader, as a traceback."""
    step = values.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise TypeError(f"step {step!r} is not a count of steps")
    files = values.get("files", {})
    if not isinstance(files, dict):
        raise TypeError(f"files is a {type(files).__name__}, not a mapping of paths to their size and checksum")
    for name, record in files.items():
        aliased = "." in name.split("/") or "//" in name or name.endswith("/")  # (``..``: not inside, said later)
        if aliased or any(ord(c) < 32 or ord(c) == 127 for c in name):
            # one spelling per file (``a/./b`` would verify b twice) and nothing that rewrites the terminal
            raise TypeError(f"files lists {name.encode('unicode_escape').decode()!r}, not a plain relative path")
        if not (
            isinstance(record, dict)
            and isinstance(record.get("bytes"), int)
            and isinstance(record.get("xxh3_128"), str)
        ):
            raise TypeError(f"files[{name!r}] is {record!r}, not {{'bytes': <int>, 'xxh3_128': <hex>}}")
    stage = values.get("zero_stage")
    if stage is not None and (not isinstance(stage, int) or isinstance(stage, bool) or stage not in range(4)):
        raise TypeError(f"zero_stage {stage!r} is not a ZeRO stage (0 to 3)")
    if not isinstance(values.get("save"), (str, type(None))):
        raise TypeError(f"save {values['save']!r} is not a save's label")
    if values.get("engine") not in (None, "deepspeed"):  # the only engine whose state mtk's checkpoints hold
        raise TypeError(f"engine {values['engine']!r} is not an engine mtk saves for (null or 'deepspeed')")
    if not isinstance(values.get("run_id"), (str, type(None))):
        raise TypeError(f"run_id {values['run_id']!r} is not a run's label")
    pieces = values.get("pieces")
    if pieces is not None and (not isinstance(pieces, int) or isinstance(pieces, bool) or pieces < 1):
        raise TypeError(f"pieces {pieces!r} is not a positive count")
    if pieces is not None and pieces > len(files):  # each piece is a listed file: bounds what a reader opens
        raise TypeError(f"pieces {pieces} is more than the {len(files)} files the checkpoint lists")
    for key in ("model", "data", "versions", "counts"):
        if not isinstance(values.get(key, {}), dict):
            raise TypeError(f"{key} is not a JSON object")
    _check_base_model(values.get("base_model"))
    data = values.get("data", {})
    step = data.get("accelerate_step", 0)
    if not _is_count(step):
        raise TypeError(f"data.accelerate_step {step!r} is not a count of steps")
    iterations = data.get("dataloader_iterations", [])
    if not isinstance(iterations, list) or not all(_is_count(i) for i in iterations):
        raise TypeError(f"data.dataloader_iterations {iterations!r} is not a list of counts (one per DataLoader)")
    if not isinstance(data.get("stream", {}), dict):
        raise TypeError(f"data.stream {data['stream']!r} is not a JSON object (what identifies the training rows)")
    counts = values.get("counts", {})
    for key in ("optimizer_steps", "fewest_optimizer_steps"):
        steps = counts.get(key)
        if steps is not None and not _is_count(steps):
            raise TypeError(f"counts.{key} {steps!r} is not a count of steps")
    positions = counts.get("scheduler_positions", [])
    if not isinstance(positions, list) or not all(p is None or isinstance(p, int) for p in positions):
        raise TypeError(f"counts.scheduler_positions {positions!r} is not a list of positions")
    rates = counts.get("learning_rates", [])
    if not isinstance(rates, list) or not all(
        isinstance(group, list) and all(type(r) in (int, float) for r in group) for group in rates
    ):
        raise TypeError(f"counts.learning_rates {rates!r} is not a list (per optimizer) of lists of numbers")
    sums = counts.get("engine_state", [])
    if not isinstance(sums, list) or not all(
        isinstance(four, list) and len(four) == 4 and all(type(x) in (int, float) for x in four) for four in sums
    ):
        raise TypeError(f"counts.engine_state {sums!r} is not a list (per rank) of four sums")


_FINGERPRINT = ("parameters", "elements", "sum", "sum_abs", "sum_sq")  # mtk.checkpoint.base_model.fingerprint's


def _check_base_model(base: Any) -> None:
    """``None`` (full weights), or the frozen base an adapter checkpoint names: ``name_or_path`` and ``peft_type``
    strings and the base's fingerprint of numbers (resume compares it, export reads it)."""
    if base is None:
        return
    record = base.get("fingerprint") if isinstance(base, dict) else None
    if not (
        isinstance(base, dict)
        and isinstance(base.get("name_or_path"), str)
        and isinstance(base.get("peft_type"), str)
        and isinstance(record, dict)
        and all(type(record.get(key)) in (int, float) for key in _FINGERPRINT)
        and isinstance(base.get("dtype", ""), str)
    ):
        raise TypeError(
            f"base_model {base!r} is neither null nor {{'name_or_path': <str>, 'peft_type': <str>, 'fingerprint': "
            f"{{{', '.join(_FINGERPRINT)}}}}}"
        )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass
class CheckpointMeta:
    """Everything ``metadata.json`` holds.

    Attributes:
        step: optimizer steps completed when it was written.
        topology: the layout that wrote it.
        versions: mtk, torch, transformers, accelerate.
        model: ``{"class", "rules", "config"}`` of the model.
        data: the data position (micro-batches seen, samples per micro-batch, loader epochs).
        engine: ``"deepspeed"`` when DeepSpeed's state sits in ``deepspeed/``; else ``None``.
        zero_stage: DeepSpeed's ZeRO stage, with that engine.
        run_id: the run (launch) that wrote it.
        files: ``{relative path: {"bytes", "xxh3_128"}}`` of every other file.
        base_model: for an adapter-only (LoRA) checkpoint, the frozen base it was trained on
            (:func:`~mtk.checkpoint.base_model.base_record`); ``None`` when the weights are all here.
        counts: what the files count at this step, checked against them at load (:mod:`~mtk.checkpoint.counts`):
            ``optimizer_steps`` (the most any optimizer state counts, ``None`` if none keeps a count) and
            ``scheduler_positions`` (one per scheduler); under an engine, ``engine_state`` (every rank's sums of
            its optimizer state and of the weights the engine's own files hold). Empty in checkpoints written before
            the record.
        save: the label of the save that wrote it, which each of its files carries too (:mod:`~mtk.checkpoint.labels`);
            ``None`` in checkpoints written before labels.
        pieces: ``None`` when each (tp, pp) rank's tensors are saved whole; else how many flat pieces they are
            saved in (FSDP2's ``dp_shard`` size, ZeRO-3's DP size; even 1), each written by the rank that holds it
            (``tpXX-ppYY-pieceZZ``).
        format: the format version; readers refuse others.
        rng: filled on load (this rank's restored RNG states, e.g. the fp16 scaler); never written.
    """

    step: int
    topology: Layout
    versions: dict[str, str] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    engine: str | None = None
    zero_stage: int | None = None
    run_id: str | None = None
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    base_model: dict[str, Any] | None = None
    counts: dict[str, Any] = field(default_factory=dict)
    save: str | None = None
    pieces: int | None = None
    format: str = FORMAT
    rng: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_json(self) -> str:
        record = dataclasses.asdict(self)
        record.pop("rng")
        record["topology"] = _layout_record(self.topology)
        return json.dumps(record, indent=1, default=str)

    @classmethod
    def from_json(cls, text: str | bytes, where: Path) -> CheckpointMeta:
        """Parse ``metadata.json``; one clear line for anything that is not this format's metadata."""
        try:
            record = jsonio.loads(text)
            if not isinstance(record, dict):
                raise TypeError("not a JSON object")
            if record.get("format") not in _READABLE:
                raise CheckpointError(f"{where} has format {record.get('format')!r}, expected {FORMAT!r}")
            known = {f.name for f in dataclasses.fields(cls)} - {"rng"}
            values = {key: value for key, value in record.items() if key in known}
            values["topology"] = _layout_from_record(record["topology"])
            _check_types(values)
            return cls(**values)
        except CheckpointError:
            raise
        except (ValueError, TypeError, KeyError, LayoutError) as err:
            raise CheckpointError(
                f"{where} is not valid mtk checkpoint metadata ({err}); the file is damaged"
            ) from None


def _newest_checkpoint_inside(folder: Path) -> Path | None:
    """The newest complete ``step_N`` / ``checkpoint-N`` directly in ``folder`` (a run's output directory given
    where one of its checkpoints was meant), else ``None``."""
    found = []
    for entry in folder.iterdir():
        match = re.fullmatch(r"(?:step_|checkpoint-)(\d+)", entry.name)
        if match and holds_checkpoint(entry):
            found.append((int(match[1]), entry))
    return max(found)[1] if found else None


def read_metadata(directory: str | Path) -> CheckpointMeta:
    """The metadata of a complete checkpoint; a clear error for anything else."""
    paths = CheckpointPaths(Path(directory))
    if paths.root.exists() and not paths.root.is_dir():
        raise CheckpointError(f"{paths.root} is a file, not a checkpoint directory; give a checkpoint's folder")
    if not paths.root.is_dir():
        raise CheckpointError(f"checkpoint directory {paths.root} does not exist")
    if not paths.metadata.is_file():
        inside = _newest_checkpoint_inside(paths.root)
        hint = f"; it is a run's folder: its newest checkpoint is {inside}" if inside else " (an interrupted save?)"
        raise CheckpointError(f"{paths.root} is not a complete mtk checkpoint (no metadata.json){hint}")
    return CheckpointMeta.from_json(paths.metadata.read_bytes(), paths.metadata)  # (bytes: not UTF-8 is damage)
