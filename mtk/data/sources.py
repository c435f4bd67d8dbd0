"""Local training data, read through ``datasets``: a file, a folder of files of one kind, or a folder
written by ``Dataset.save_to_disk``. There is no hub: ``--data`` is always a local path."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

import datasets
import pyarrow as pa
from datasets import Dataset, DatasetDict, Value, load_dataset, load_from_disk

from mtk import jsonio
from mtk.data.json_depth import check_json_depth
from mtk.errors import DataError

__all__ = ["COMPRESSIONS", "FORMATS", "data_fingerprint", "load_data", "rows_digest"]

# file suffix -> the ``datasets`` builder that reads it
FORMATS = {
    ".jsonl": "json",
    ".json": "json",
    ".txt": "text",
    ".text": "text",
    ".csv": "csv",
    ".parquet": "parquet",
}


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """``datasets`` logs its own ERROR line for a file it cannot parse; mtk reports it as its one line."""
    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)


COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")  # datasets decompresses these by their suffix
_DECOMPRESSORS = {".zst": "zstandard", ".lz4": "lz4"}  # the packages datasets needs for them (not its dependencies)


def _kind(path: Path) -> str | None:
    """The ``datasets`` builder for a data file, by suffix in any case, under one compression suffix or none."""
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes = suffixes[:-1]
    return FORMATS.get(suffixes[-1]) if suffixes else None


def _check_decompressors(files: list[Path], path: Path, option: str) -> None:
    """One line where a file's compression needs a package that is not installed: datasets says only that the
    compression type is "not supported", which reads as a broken file."""
    for file in files:
        package = _DECOMPRESSORS.get(file.suffix.lower())
        if package is not None and importlib.util.find_spec(package) is None:
            raise DataError(
                f"{option} {path}: {file.name} is {file.suffix.lower()[1:]}-compressed, which datasets reads with the "
                f"{package} package, not installed here: pip install {package} (or decompress the file)"
            )


def _data_files(path: Path, option: str) -> list[Path]:
    """Every file of a folder (hidden ones aside): each must be a data file; none is skipped without a word, and a
    folder inside it (whose files would not be read) is one line."""
    files = sorted(p for p in path.iterdir() if not p.name.startswith("."))
    folders = [p.name for p in files if p.is_dir()]
    if folders:
        raise DataError(
            f"{option} {path} holds the folder {folders[0]!r}, whose files would not be read (mtk reads the files "
            f"directly in {path}); move its files up into {path}, or the folder out"
        )
    odd = [p.name for p in files if not p.is_dir() and not p.is_file()]  # a broken link, a FIFO, a socket, a device
    if odd:
        raise DataError(
            f"{option} {path} holds {odd[0]!r}, which is not a readable regular file (a broken link, a pipe or a "
            f"device); remove it or point {option} at the files"
        )
    unknown = [p.name for p in files if p.is_file() and _kind(p) is None]
    if unknown:
        raise DataError(
            f"{option} {path} holds {unknown[0]!r}, which is not a data file ({'/'.join(FORMATS)}, optionally "
            f"{'/'.join(COMPRESSIONS)}); move it out or point {option} at the files"
        )
    return [p for p in files if p.is_file()]


def _saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists())


def _read_files(path: Path) -> list[Path]:
    """The files :func:`load_data` reads for ``--data path``: the file; a folder's data files; a ``save_to_disk``
    folder's arrow files as its ``state.json`` lists them (not the ``cache-*.arrow`` that ``map`` leaves)."""
    if not path.is_dir():
        return [path]
    if not _saved_dataset(path):
        return _data_files(path, "--data")
    files = []
    for state in sorted([path / "state.json", *path.glob("*/state.json")]):
        if state.is_file():
            listed = jsonio.read(state).get("_data_files", [])
            files += [state.parent / entry["filename"] for entry in listed]
    return files


def data_fingerprint(path: str | Path) -> str:
    """SHA-256 of what ``--data path`` reads (file names relative to it, and contents).

    Contents, not modification times: a data set copied to another machine for a resume keeps its digest.
    """
    root = Path(path)
    digest = hashlib.sha256()
    for file in _read_files(root):
        digest.update(os.fsencode(file.relative_to(root) if root.is_dir() else "") + b"\0")  # (any bytes a name has)
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()


def rows_digest(dataset: Dataset) -> str:
    """SHA-256 of a dataset's rows as a trainer reads them (after its tokenizing, truncating and packing), in
    their order: Arrow IPC batches of the rows (an index mapping of ``select``/``shuffle`` applied), so the same
    rows give the same digest on every rank and machine, and other data or other preprocessing settings another.
    Linear in the data's size (hundreds of MB a second), computed once a run."""
    digest = hashlib.sha256()
    for table in dataset.with_format("arrow").iter(batch_size=8192):  # pa.Table of up to 8192 rows
        # (chunks and schema metadata differ with how the rows are stored: one chunk of the values alone)
        batch = table.replace_schema_metadata(None).combine_chunks()
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_table(batch)
        digest.update(sink.getvalue())
    return digest.hexdigest()


def _root_cause(err: BaseException) -> str:
    root = err
    while root.__cause__ is not None or root.__context__ is not None:  # the parser's own message
        root = root.__cause__ or root.__context__  # type: ignore[assignment]
    text = str(root).strip()
    return text.splitlines()[0] if text else type(root).__name__


def _which_file(kind: str | None, files: list[Path], err: BaseException) -> str:
    """Why a folder's files could not be read together, naming the file: the first that cannot be read alone, or
    the first whose columns differ from the first file's (datasets reads a folder as one table and says only
    "Couldn't cast")."""
    first: tuple[Path, dict[str, str]] | None = None
    for file in files:
        try:
            with _quiet_datasets():
                part = load_dataset(kind, data_files=[str(file)], split="train")
        except Exception as own:
            return f"{file.name}: {_root_cause(own)}"
        columns = {name: str(feature) for name, feature in part.features.items()}
        if first is None:
            first = (file, columns)
        elif columns != first[1]:
            return f"{file.name} has columns {columns}, {first[0].name} has {first[1]}: give files of one schema"
    return _root_cause(err)


def _first_malformed_line(files: list[Path]) -> str | None:
    """The first line of the JSON lines ``files`` that is no JSON document (or gives a key twice, which Python's
    reader takes the last of and pyarrow's calls "Trailing data"), named by file and line; ``None`` when each line
    parses (the problem is elsewhere: mixed types, a ``.json`` array)."""
    for file in files:
        if file.suffix.lower() != ".jsonl":
            continue
        with open(file, "rb") as lines:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    try:  # (bytes that are not UTF-8 pyarrow takes: not what failed)
                        jsonio.loads(line.decode("utf-8", errors="surrogateescape"))
                    except json.JSONDecodeError as err:  # (its own "line 1 column 9" is of the one line)
                        where = f", column {err.colno}" if type(err) is json.JSONDecodeError else ""
                        return f"{file.name} line {number}{where}: {err.msg}"
    return None


def load_data(path: str | Path, option: str = "--data") -> Dataset:
    """The rows of a local file, a folder of files of one kind, or a ``save_to_disk`` folder (its
    ``train`` split when it holds several). Anything unreadable is a :class:`DataError` naming ``option``."""
    path = Path(path)
    kind: str | None = None
    if _saved_dataset(path):
        try:
            saved = load_from_disk(str(path))
        except Exception as err:
            raise DataError(f"{option} {path} could not be read as a saved dataset ({_root_cause(err)})") from None
        if isinstance(saved, DatasetDict):
            if "train" not in saved:
                raise DataError(f"{option} {path} holds splits {sorted(saved)}; give the folder of one split")
            saved = saved["train"]
        dataset = saved
    else:
        files = _data_files(path, option) if path.is_dir() else [path]
        if not files or not all(p.is_file() for p in files):
            raise DataError(
                f"{option} {path} does not exist or holds no {'/'.join(FORMATS)} files (or a save_to_disk dataset)"
            )
        kinds = {_kind(p) for p in files}
        if None in kinds or len(kinds) > 1:
            raise DataError(f"{option} {path}: use files of one kind among {sorted(FORMATS)}")
        kind = kinds.pop()
        if all(p.stat().st_size == 0 for p in files):
            raise DataError(f"{option} {path} is empty; give it at least one row")
        _check_decompressors(files, path, option)
        if kind == "json":  # pyarrow's reader dies of SIGSEGV, without a line, on rows nested too deeply
            for file in files:
                check_json_depth(file, option)
        options = _csv_options(files[0]) if kind == "csv" else {}
        try:
            with _quiet_datasets():
                dataset = load_dataset(kind, data_files=[str(p) for p in files], split="train", **options)
        except Exception as err:  # datasets' own errors (malformed JSON, ...), as one line
            if "corresponds to no data" in str(err):  # (its word for files of no rows: a CSV of a header alone)
                raise DataError(f"{option} {path} has no rows") from None
            cause = _first_malformed_line(files) if kind == "json" else None
            cause = cause or (_root_cause(err) if len(files) == 1 else _which_file(kind, files, err))
            raise DataError(
                f"{option} {path} could not be read as {kind} ({cause}); check the file's format"
            ) from None
    if len(dataset) == 0:
        raise DataError(f"{option} {path} has no rows")
    _check_text(dataset, path, option)
    return _csv_text_columns(dataset) if kind == "csv" else dataset


# A CSV cell has no type and no null: a text column is text even where every cell looks like a number ("42" read as
# the integer 42) or like pandas' missing values ("NA", "None", "null": read as None), and an empty cell is the
# empty string, as {"text": ""} is in JSON lines (read as None, then refused)
CSV_TEXT_COLUMNS = ("text", "prompt", "completion", "chosen", "rejected")  # (the last two: preference pairs)
# pandas' default missing-value strings (read_csv's documented list), kept for every other column (an empty label)
_PANDAS_MISSING = ["", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN",
                   "<NA>", "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null"]  # fmt: skip


def _csv_options(file: Path) -> dict[str, object]:
    """pandas' options (through ``datasets``) that read a CSV's text columns as the text they hold: through ``str``,
    with no missing-value strings; the other columns as pandas reads them. The header is the first file's."""
    import pandas as pd

    try:
        header = list(pd.read_csv(file, nrows=0).columns)
    except Exception:  # (unreadable: datasets' own reading says why, in one line)
        return {}
    return {
        "converters": {name: str for name in CSV_TEXT_COLUMNS if name in header},
        "keep_default_na": False,
        "na_values": {name: _PANDAS_MISSING for name in header if name not in CSV_TEXT_COLUMNS},
    }


def _csv_text_columns(dataset: Dataset) -> Dataset:
    """The text columns of a CSV (read through ``str``: "42" stays text) with empty cells as ``""``, typed
    ``large_string`` as datasets types a CSV's text column (the rows' digest, which a resume compares, depends
    on it)."""
    columns = [name for name in CSV_TEXT_COLUMNS if name in dataset.column_names]
    if any(dataset.data.column(name).null_count for name in columns):  # (Arrow's count: no rows read)
        dataset = dataset.map(
            lambda batch: {name: ["" if cell is None else cell for cell in batch[name]] for name in columns},
            batched=True,
        )
    for name in columns:
        if dataset.features[name] != Value("large_string"):
            dataset = dataset.cast_column(name, Value("large_string"))
    return dataset


def _check_text(dataset: Dataset, path: Path, option: str) -> None:
    """Every string is UTF-8 (the JSON reader keeps invalid bytes, which only fail when a row is read, deep in
    tokenization): one pass of Arrow's own validation, and the first bad row named when it fails."""
    try:
        dataset.data.validate(full=True)
    except pa.ArrowInvalid:
        row = next((i for i in range(len(dataset)) if not _decodes(dataset, i)), "?")
        raise DataError(f"{option} {path} row {row} is not UTF-8 text; re-encode the file as UTF-8") from None


def _decodes(dataset: Dataset, index: int) -> bool:
    try:
        dataset[index]
    except UnicodeDecodeError:
        return False
    return True
