"""Checksums that let a checkpoint prove it is the one that was written, and fsync before it is published.

Every file of ``step_N/`` (except ``metadata.json``, which holds the list) is recorded in the metadata
with its size and checksum. The ranks share the work: after everyone's files are in place, rank ``r``
hashes and fsyncs every ``world``-th file of the sorted list, and rank 0 gathers the records into the
metadata it writes last. Reading a checkpoint back (resume, ``mtk export``, ``mtk verify-checkpoint``)
checks the same way and refuses, naming the file, anything missing, resized or changed, so a flipped
byte or a shard copied in from another run or step is found before it is trained on.

The checksum is XXH3-128 (``xxhash``, already a dependency of ``datasets``; ``xxh128sum`` checks a file by
hand): a checksum against damage and mix-ups, not a signature against an attacker. It is hashed from a
memory map of the file just written (still in the page cache), at ~14 GB/s, on threads (xxhash releases
the GIL): the big files a rank writes itself are hashed in the background while it writes the next
(:class:`Checksums`), the rest by a thread per core at the end. Integrity costs a few percent of a
save (docs/reliability.md, ``examples/benchmarks/checkpoint_integrity_cost.py``); SHA-256 would cost a quarter
of it.
"""

from __future__ import annotations

import functools
import mmap
import os
import re
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist
import xxhash

from mtk.checkpoint.atomic import MARKER, fsync_dir
from mtk.checkpoint.labels import label_problem
from mtk.checkpoint.meta import FIRST_FORMAT, CheckpointMeta, read_metadata
from mtk.checkpoint.paths import shard_name
from mtk.errors import CheckpointError

__all__ = [
    "ALGORITHM",
    "Checksums",
    "checksum_files",
    "contained",
    "file_checksum",
    "links",
    "list_files",
    "read_verified",
    "verify_files",
]

ALGORITHM = "xxh3_128"
_METADATA = "metadata.json"
_T = TypeVar("_T")


def list_files(root: Path) -> list[str]:
    """Every regular file under ``root`` but the metadata (and mtk's in-progress marker), as sorted POSIX
    paths relative to it. Symbolic links are not followed (:func:`links` names them), nor is anything else that is
    no regular file read (:func:`special_files` names it)."""
    skip = {_METADATA, MARKER}
    files = []
    for directory, _, names in os.walk(root):  # never descends into a linked directory
        for name in names:
            path = Path(directory) / name
            if name not in skip and path.is_file() and not path.is_symlink():
                files.append(path.relative_to(root).as_posix())
    return sorted(files)


def special_files(root: Path) -> list[str]:
    """What under ``root`` is neither a directory, a regular file nor a link (a FIFO, a socket, a device), relative
    to it: no file of a checkpoint, refused without being opened (opening a FIFO blocks), where it was passed over
    as no file at all."""
    found = []
    for directory, _, names in os.walk(root):
        for name in names:
            path = Path(directory) / name
            if not path.is_symlink() and not path.is_file() and not path.is_dir():
                found.append(path.relative_to(root).as_posix())
    return sorted(found)


def links(root: Path) -> list[str]:
    """The symbolic links under ``root`` (files or directories), relative to it: a checkpoint holds only its own
    files, so a link in it, wherever it points, is refused rather than followed."""
    found = []
    for directory, subdirs, names in os.walk(root):
        found += [
            (Path(directory) / n).relative_to(root).as_posix()
            for n in subdirs + names
            if (Path(directory) / n).is_symlink()
        ]
    return sorted(found)


def contained(root: Path, name: str) -> Path:
    """``root / name`` for a file name the metadata lists, after checking that it stays inside the checkpoint
    (relative, no ``..``, no link on the way); one clear error that names only the entry otherwise, never
    anything about the file it would point at."""
    parts = Path(name).parts
    inside = bool(parts) and not Path(name).is_absolute() and ".." not in parts and "\\" not in name
    path = root / name
    if inside:
        walked = root
        try:
            for part in parts:
                walked = walked / part
                if walked.is_symlink():
                    inside = False
                    break
        except OSError:  # a name the file system cannot hold (longer than its limit): no file of the checkpoint
            inside = False
    if not inside:
        raise CheckpointError(
            f"{root}/metadata.json lists {name!r}, which is not a file inside the checkpoint; the metadata is "
            "damaged or crafted: use another checkpoint"
        )
    return path


def file_checksum(path: Path, *, sync: bool = False) -> str:
    """The file's XXH3-128 as hex; with ``sync``, also fsync it."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            digest = xxhash.xxh3_128(b"").hexdigest()
        else:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:  # no copy out of the page cache
                digest = xxhash.xxh3_128(view).hexdigest()
        if sync:
            os.fsync(f.fileno())  # its bytes are on disk before the directory is renamed into place
    return digest


def _share(items: list[str]) -> list[str]:
    """This rank's share of ``items`` (all of them without a process group)."""
    if not dist.is_initialized():
        return items
    return items[dist.get_rank() :: dist.get_world_size()]


def _each(fn: Callable[[str], _T], names: Iterable[str]) -> list[_T]:
    """``fn`` of every name, on a thread per core: hashing and fsync release the GIL."""
    names = list(names)
    if len(names) < 2:
        return [fn(name) for name in names]
    with ThreadPoolExecutor(max_workers=min(len(names), os.cpu_count() or 1)) as pool:
        return list(pool.map(fn, names))


def _gather(local: Any) -> list[Any]:
    if not dist.is_initialized():
        return [local]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return gathered


def _record(root: Path, name: str) -> dict[str, Any]:
    return {"bytes": (root / name).stat().st_size, ALGORITHM: file_checksum(root / name, sync=True)}


class Checksums:
    """Files this rank has finished writing, hashed and fsynced on a background thread while it writes the
    next one, so a save's hashing overlaps its writing. :func:`checksum_files` takes the results."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._pending: dict[str, Future[dict[str, Any]]] = {}

    def add(self, path: Path) -> None:
        """``path`` (under the root) is complete: hash it."""
        name = Path(path).relative_to(self.root).as_posix()
        self._pending[name] = self._pool.submit(_record, self.root, name)

    def results(self) -> dict[str, dict[str, Any]]:
        try:
            return {name: future.result() for name, future in self._pending.items()}
        finally:
            self._pool.shutdown()


def checksum_files(root: Path, done: Checksums | None = None) -> dict[str, dict[str, Any]]:
    """``{relative path: {"bytes", "xxh3_128"}}`` of every file under ``root``, fsynced. Collective when a
    process group exists (every rank calls it, each hashes its share, every rank gets the whole record).

    ``done``: the files this rank hashed already while writing them; the others are shared out.
    """
    root = Path(root)
    own = done.results() if done is not None else {}
    claimed = {name for names in _gather(sorted(own)) for name in names}
    names = _share([name for name in list_files(root) if name not in claimed])
    mine = {**own, **dict(zip(names, _each(lambda name: _record(root, name), names), strict=True))}
    for directory in {(root / name).parent for name in mine} | {root}:
        fsync_dir(directory)
    merged: dict[str, dict[str, Any]] = {}
    for part in _gather(mine):
        merged.update(part)
    return dict(sorted(merged.items()))


def _problem(root: Path, name: str, record: dict[str, Any], label: str | None) -> str | None:
    try:
        path = contained(root, name)
    except CheckpointError as err:
        return str(err)
    try:
        return _file_problem(root, name, path, record, label)
    except OSError as err:  # a name the file system cannot take (too long), a file it cannot read
        return f"{root}: the recorded file {name[:80]!r} cannot be read ({err.strerror or err})"


def _file_problem(root: Path, name: str, path: Path, record: dict[str, Any], label: str | None) -> str | None:
    if not path.is_file():
        if path.exists() or path.is_symlink():  # a folder, a FIFO, a device, a dangling link in its place
            return f"{path} is not a regular file; the checkpoint recorded a file of {record['bytes']} bytes there"
        return f"{path} is missing"
    size = path.stat().st_size
    if size != record["bytes"]:
        return f"{path} has {size} bytes, the checkpoint recorded {record['bytes']}"
    if file_checksum(path, sync=False) != record[ALGORITHM]:
        return f"{path} does not match its recorded {ALGORITHM} (damaged, or replaced by another run's or step's file)"
    return label_problem(root, name, label)


def verify_files(
    root: Path, recorded: dict[str, dict[str, Any]], label: str | None = None, *, listed: list[str] | None = None
) -> list[str]:
    """Problems with the files under ``root`` against ``recorded``, and with the save labels the files carry against
    ``label`` (:mod:`~mtk.checkpoint.labels`); empty when every file matches. With ``listed`` (a checkpoint without
    checksums), only those files' labels.

    Collective when a process group exists: each rank checks its share and every rank returns the
    same full list, so every rank can refuse the checkpoint together (no rank is left in a collective).
    A file the checkpoint does not list (a shard of another layout copied in) is a problem too.
    """
    root = Path(root)
    first = not dist.is_initialized() or dist.get_rank() == 0
    special = [f"{root / name} is no regular file (a FIFO, socket or device); a checkpoint holds only its own files"
               for name in special_files(root)] if first else []  # fmt: skip
    if listed is not None:  # no record to check against: only the labels of ``listed``
        mine = [p for p in _each(lambda name: label_problem(root, name, label), _share(listed)) if p]
        return [problem for part in _gather(mine + special) for problem in part]
    names = sorted(recorded)
    mine = [p for p in _each(lambda name: _problem(root, name, recorded[name], label), _share(names)) if p]
    if first:
        mine += [f"{root / name} is not part of the checkpoint" for name in list_files(root) if name not in recorded]
        mine += [f"{root / name} is a symbolic link; a checkpoint holds only its own files" for name in links(root)]
    return [problem for part in _gather(mine + special) for problem in part]


def _unlisted_weights(meta: CheckpointMeta) -> list[str]:
    """The weight files the checkpoint's layout writes (one per (tp, pp) rank, or per piece of each) that its file
    list leaves out: each listed file may verify while a shard is missing (a resume finds out only when it reads)."""
    pieces: list[int | None] = [None] if meta.pieces is None else list(range(meta.pieces))
    t = meta.topology
    expected = [
        f"model/{shard_name(tp, pp, piece)}.safetensors"
        for tp in range(t.tp_size)
        for pp in range(t.pp_size)
        for piece in pieces
    ]
    return [name for name in expected if name not in meta.files]


def _check_format_fields(directory: str | Path, meta: CheckpointMeta) -> None:
    """A metadata of the first format records nothing of what later formats added (a run id, checksums, a save
    label, counts, pieces): rewriting a checkpoint's format to the first would otherwise turn every check off."""
    if meta.format != FIRST_FORMAT:
        return
    later = [name for name in ("run_id", "files", "save", "counts", "pieces") if getattr(meta, name)]
    if later:
        raise CheckpointError(
            f"{directory}/metadata.json says format {FIRST_FORMAT} but records {later[0]!r}, which only later "
            "formats write; the metadata is crafted or damaged: use another checkpoint"
        )


def _check_labelled_record(directory: str | Path, meta: CheckpointMeta) -> None:
    """A labelled save (every save since save labels) records its data position and the counts of what it wrote:
    the schedulers' positions, and, of optimizer files mtk or an engine wrote, their steps and learning rates (an
    engine's since 2026-11-28: a labelled DeepSpeed checkpoint of the day before is refused). A record removed from
    its metadata would otherwise switch the check it feeds off, as an emptied list would."""
    if meta.save is None:
        return
    if not meta.save.startswith(f"step_{meta.step}-"):  # the label is drawn for the step the save writes
        raise CheckpointError(
            f"{directory}/metadata.json records step {meta.step}, but the save is labelled {meta.save!r}; the "
            "metadata is crafted or damaged: use another checkpoint"
        )
    needed = ["data.micro_batches", "counts.scheduler_positions"]
    if meta.engine is not None or any(name.startswith("optimizer/") for name in meta.files):  # (an engine's own too)
        needed += ["counts.optimizer_steps", "counts.fewest_optimizer_steps", "counts.learning_rates"]
    data = meta.data
    records = {"data": data, "counts": meta.counts}
    missing = [name for name in needed if name.split(".")[1] not in records[name.split(".")[0]]]
    # values a save writes as numbers (the counts of steps may be null: no optimizer state yet)
    missing += ["data.micro_batches"] if data.get("micro_batches", 0) is None else []
    if data.get("samples_per_micro_batch") is not None and data.get("samples") is None:
        missing.append("data.samples")  # the product that ties the position to itself
    if missing:
        raise CheckpointError(
            f"{directory}/metadata.json records no {missing[0]}, which every save since save labels writes (this one "
            f"is labelled {meta.save!r}); the metadata is crafted or damaged: use another checkpoint"
        )
    if data.get("samples_per_micro_batch") is None and data.get("micro_batches"):
        raise CheckpointError(
            f"{directory}/metadata.json records {data['micro_batches']} micro-batches consumed but not their size; a "
            "save that consumed data records both: the metadata is crafted or damaged: use another checkpoint"
        )


def _check_scheduler_count(directory: str | Path, meta: CheckpointMeta) -> None:
    """A metadata that records the schedulers' positions records one per scheduler file (none left out: an empty
    list would switch the position check off)."""
    positions = meta.counts.get("scheduler_positions")
    if positions is None or not meta.files:
        return
    held = [name for name in meta.files if re.fullmatch(r"scheduler(_\d+)?\.pt", name)]
    if len(held) != len(positions):
        raise CheckpointError(
            f"{directory}/metadata.json records the positions of {len(positions)} schedulers, the checkpoint holds "
            f"{len(held)} scheduler files; not as mtk wrote it (crafted, or damaged): use another checkpoint"
        )


def missing_files_are_one_line(load: Callable[..., _T]) -> Callable[..., _T]:
    """A loader of the checkpoint in its first argument: a file it needs that is gone and that the metadata does not
    list (deleted, and left out of the list: no checksum could miss it) is one line, not a traceback."""

    @functools.wraps(load)
    def loading(directory: str | Path, *args: Any, **kwargs: Any) -> _T:
        try:
            return load(directory, *args, **kwargs)
        except FileNotFoundError as err:
            raise CheckpointError(
                f"{err.filename or directory} is missing, and {directory}/metadata.json does not list it: the "
                "checkpoint is incomplete or crafted: use another one"
            ) from None

    return loading


def read_verified(directory: str | Path) -> CheckpointMeta:
    """The metadata of a complete checkpoint whose every file matches it; else one clear error.

    Collective when a process group exists (every rank raises the same error). A checkpoint of the
    first format (before checksums) is read unverified; one of a later format that lists no files is refused
    (mtk never writes one: its weights are always listed).
    """
    meta = read_metadata(directory)
    _check_format_fields(directory, meta)
    linked = links(Path(directory))
    if linked and meta.format == FIRST_FORMAT:  # format 2 names links among its problems (verify_files)
        raise CheckpointError(
            f"{Path(directory) / linked[0]} is a symbolic link; a checkpoint holds only its own files (this one, of "
            f"format {FIRST_FORMAT}, has no checksums, and links are refused whatever the format)"
        )
    if meta.format != FIRST_FORMAT and not meta.files:
        raise CheckpointError(
            f"{directory}/metadata.json lists no files, so nothing in the checkpoint can be verified; the metadata "
            "is damaged or crafted: use another checkpoint"
        )
    if meta.format != FIRST_FORMAT:
        unlisted = _unlisted_weights(meta)
        if unlisted:
            t = meta.topology
            raise CheckpointError(
                f"{directory}/metadata.json lists no {unlisted[0]}, which its layout (tp {t.tp_size}, pp {t.pp_size}"
                f"{'' if meta.pieces is None else f', {meta.pieces} pieces'}) writes; the checkpoint is incomplete or "
                "crafted: use another one"
            )
    if meta.format == FIRST_FORMAT:  # files mtk labels cannot be of a save before labels
        problems = verify_files(Path(directory), {}, None, listed=list_files(Path(directory)))
        if problems:
            raise CheckpointError(f"{problems[0]}: a checkpoint of format {FIRST_FORMAT} holds no labelled file")
    _check_labelled_record(directory, meta)
    _check_scheduler_count(directory, meta)
    if meta.files:
        problems = verify_files(Path(directory), meta.files, meta.save)
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise CheckpointError(
                f"{problems[0]}{more}; the checkpoint cannot be trusted: use another one "
                "(`mtk verify-checkpoint` checks one)"
            )
    return meta
