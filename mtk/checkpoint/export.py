"""Export a training checkpoint (any TP/PP/DP layout) to a normal HF model directory, offline.

Each tensor is merged from the per-rank shards (:class:`ShardedCheckpointReader`), vocabulary
padding dropped, and written with HF's names and layout into ``model.safetensors`` (or shards of at
most ``max_shard_size`` plus ``model.safetensors.index.json``) next to ``config.json`` (and the
tokenizer files when the run saved them). The result loads with ``AutoModel*.from_pretrained``.
The checkpoint's checksums are verified first. Everything is written into a temporary
``<out>.<random>.incomplete`` beside ``out`` and renamed when complete (and verified); nothing else is
removed, ever.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers.utils import GENERATION_CONFIG_NAME

from mtk import jsonio
from mtk.checkpoint.atomic import fsync_dir, fsync_tree, refuse_link, storage_reason
from mtk.checkpoint.hf_load import INDEX_FILE, SINGLE_FILE
from mtk.checkpoint.integrity import contained, list_files, read_verified
from mtk.checkpoint.meta import CheckpointMeta
from mtk.checkpoint.paths import CheckpointPaths
from mtk.checkpoint.reader import ShardedCheckpointReader
from mtk.errors import CheckpointError, ModelSpecError
from mtk.models import DTYPES, check_config_values, generation_config_of

__all__ = [
    "DTYPES",
    "check_new_directory",
    "copy_generation_config",
    "copy_tokenizer",
    "drop_auto_map",
    "export_checkpoint",
    "parse_size",
    "staged_directory",
]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"64KiB"`` or a number of bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?I?B?)\s*", text.upper())
    if not match or match.group(2) not in _UNITS:
        raise CheckpointError(f"--max_shard_size {text!r} is not a size; use e.g. 5GB, 500MB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def _class_name(meta: CheckpointMeta) -> str:
    """The recorded model class's name; a record missing or not a string (edited metadata) is one line, not a
    ``KeyError``."""
    name = meta.model.get("class")
    if not isinstance(name, str) or not name:
        raise CheckpointError(
            f"the checkpoint's metadata records the model class as {name!r}, not a transformers class name; the "
            "metadata is damaged: correct model.class in its metadata.json or use another checkpoint"
        )
    return name


def _model_class(meta: CheckpointMeta):
    name = _class_name(meta)
    cls = getattr(transformers, name, None)
    if cls is None:
        raise CheckpointError(
            f"the checkpoint's model class {name!r} is not in transformers {transformers.__version__}"
        )
    return cls


def _write_weights(reader: ShardedCheckpointReader, out: Path, dtype, limit: int, progress: bool) -> None:
    """Merged tensors into safetensors files of at most ``limit`` bytes (+ an index when several)."""
    files: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        save_file(current, str(out / f"part-{len(files)}.safetensors"), metadata={"format": "pt"})
        files.append(list(current))
        current.clear()

    for name in tqdm(reader.names(), desc="export", disable=not progress, unit="tensor"):
        tensor = reader.full(name)
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if current and size + tensor.nbytes > limit:
            flush()
            size = 0
        current[name] = tensor.contiguous()
        size += tensor.nbytes
    flush()
    if len(files) == 1:
        (out / "part-0.safetensors").rename(out / SINGLE_FILE)
        return
    weight_map = {}
    for i, names in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        (out / f"part-{i}.safetensors").rename(out / final)
        weight_map.update(dict.fromkeys(names, final))
    total_size = sum((out / f).stat().st_size for f in set(weight_map.values()))
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))


def _verify(out: Path, meta: CheckpointMeta, reader: ShardedCheckpointReader, dtype) -> None:
    """Reload with HF's own from_pretrained and compare every exported tensor, bit for bit."""
    model = _model_class(meta).from_pretrained(out, dtype=dtype or "auto")
    state = model.state_dict()
    for name in reader.names():
        expected = reader.full(name)
        if dtype is not None and expected.is_floating_point():
            expected = expected.to(dtype)
        if name not in state or not torch.equal(state[name], expected):
            raise CheckpointError(f"verification failed: {name} reloaded from {out} differs from the checkpoint")


def recorded_config(checkpoint: str | Path, meta: CheckpointMeta) -> transformers.PretrainedConfig:
    """The model config the checkpoint's metadata records, built by transformers (no code from ``auto_map``).

    The metadata is data from disk (possibly edited or crafted): its values are checked as written first
    (:func:`~mtk.models.check_config_values`, the check every ``--model`` config gets), and whatever transformers
    still refuses while building the config (its strict dataclass validators raise an error that is not a
    ``ValueError``; a mapping given as a list fails as an ``AttributeError``) is one line naming the checkpoint and,
    where one field alone is refused, that field, never a traceback from ``mtk export`` or ``verify-checkpoint``."""
    config_dict = meta.model.get("config")
    if not config_dict:
        raise CheckpointError(f"{checkpoint} records no model config; it cannot be exported as an HF directory")
    where = f"{checkpoint}'s recorded model config"
    if not isinstance(config_dict, dict):
        raise CheckpointError(f"{where} is a {type(config_dict).__name__}, not a JSON object; the metadata is damaged")
    values = {k: v for k, v in config_dict.items() if k != "auto_map"}
    try:
        check_config_values(values, checkpoint, where=where)
    except ModelSpecError as err:
        raise CheckpointError(str(err)) from None
    model_type = values.get("model_type")
    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        raise CheckpointError(
            f"{where} cannot be built (model_type is {_shown(model_type)}, which transformers "
            f"{transformers.__version__} does not ship); correct model.config in its metadata.json or use another "
            "checkpoint"
        )
    try:
        config = transformers.AutoConfig.for_model(**values)
    except _CONFIG_REFUSALS as err:
        cause = err.__cause__ if isinstance(err, StrictDataclassError) and err.__cause__ else err  # the validator's
        reason = (str(cause).strip().splitlines() or ["no message"])[0][:160]
        field = _refused_field(model_type, values)
        named = f"{field} is {_shown(values[field])}: " if field else ""
        raise CheckpointError(
            f"{where} cannot be built ({named}{type(cause).__name__}: {reason}); correct model.config in its "
            "metadata.json or use another checkpoint"
        ) from None
    config.architectures = [_class_name(meta)]
    return config


# what transformers raises for values its config classes refuse: huggingface_hub's StrictDataclassError (a field of
# the wrong type, values that contradict each other) is an Exception, not a ValueError
_CONFIG_REFUSALS = (ValueError, TypeError, KeyError, AttributeError, StrictDataclassError)


def _refused_field(model_type: str, values: dict[str, Any]) -> str | None:
    """The first field of ``values`` that transformers refuses alone (a config built from the model type and that
    field only), to name it in the message; ``None`` when each is accepted alone (values that contradict each other,
    which transformers' own message names) or the model type itself is refused. Only called once building failed."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the probes' warnings (a token id past a default vocabulary): noise
    try:
        try:
            transformers.AutoConfig.for_model(model_type)
        except _CONFIG_REFUSALS:
            return None
        for name, value in values.items():
            if name == "model_type":
                continue
            try:
                transformers.AutoConfig.for_model(model_type, **{name: value})
            except _CONFIG_REFUSALS:
                return name
        return None
    finally:
        transformers.logging.set_verbosity(verbosity)


def _shown(value: Any) -> str:
    """A recorded value as JSON, cut to keep the message one short line."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def check_against_config(checkpoint: str | Path, meta: CheckpointMeta, reader: ShardedCheckpointReader) -> None:
    """Every tensor of a full-weights checkpoint is one its recorded config's model has, of that shape (what
    ``mtk export`` checks first; ``mtk verify-checkpoint`` checks it too, so that neither calls ok what the other
    refuses)."""
    _check_shapes(recorded_config(checkpoint, meta), _model_class(meta), reader, checkpoint)


def _check_shapes(config, cls, reader: ShardedCheckpointReader, checkpoint: str | Path) -> None:
    """Every tensor of the checkpoint is one the recorded config's model has, of the same shape, before anything is
    written: the config and the weights are separate records of the metadata, and a pair that disagrees wrote an
    export that transformers then refused to load (a traceback, or a broken directory with --no_verify)."""
    try:
        with torch.device("meta"):  # nothing allocated, whatever sizes the config claims
            model = cls(config)
    except Exception as err:  # the class and the config are both records of the metadata: any mismatch
        raise CheckpointError(
            f"{checkpoint}'s recorded model class {cls.__name__} cannot be built from its recorded config "
            f"({type(err).__name__}: {err}); it cannot be exported"
        ) from None
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    held = set(reader.names())
    aliases: dict[int, list[str]] = {}  # tied parameters: one tensor under several names, any of them saved
    for name, parameter in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(parameter), []).append(name)
    missing = [names[0] for names in aliases.values() if not held.intersection(names)]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{checkpoint} holds no {missing[0]}{more}, which its recorded {cls.__name__} config needs (config and "
            "weights disagree); it cannot be exported"
        )
    for name in reader.names():
        if name not in expected:
            raise CheckpointError(
                f"{checkpoint} holds {name}, which its recorded {cls.__name__} config has no place for (config and "
                "weights disagree); it cannot be exported"
            )
        if tuple(reader.full_shapes[name]) != expected[name]:
            raise CheckpointError(
                f"{checkpoint} holds {name} of shape {tuple(reader.full_shapes[name])}, its recorded config makes it "
                f"{expected[name]} (config and weights disagree); it cannot be exported"
            )


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    verify: bool = True,
    progress: bool = True,
) -> Path:
    """Merge ``checkpoint`` into an HF directory at ``out_dir``; returns it. Nothing is left on failure."""
    meta = read_verified(checkpoint)  # every shard matches its checksum: a damaged input is named, not exported
    out = Path(out_dir)
    check_new_directory(out, checkpoint)
    if meta.base_model is not None:
        raise CheckpointError(
            f"{checkpoint} holds only LoRA adapters: export them with --adapter (a PEFT directory) or --merge "
            "(the base with the adapters merged in)"
        )
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    torch_dtype = DTYPES.get(dtype) if dtype else None
    limit = parse_size(max_shard_size)
    config = recorded_config(checkpoint, meta)
    if GENERATION_CONFIG_NAME in meta.files:
        checked_generation_config(checkpoint, meta)  # (before the merge writes anything)
    with ShardedCheckpointReader(checkpoint, meta) as reader:
        reader.check_complete(optimizer=False)  # every tensor whole, from the headers: one line, not a merge's error
        reader.check_replicas_agree(optimizer=False)  # one tensor, whichever TP rank's copy is read
        _check_shapes(config, _model_class(meta), reader, checkpoint)
    with staged_directory(out) as tmp, ShardedCheckpointReader(checkpoint, meta) as reader:
        _write_weights(reader, tmp, torch_dtype, limit, progress)
        if torch_dtype is not None:
            config.dtype = torch_dtype
        config.save_pretrained(tmp)
        copy_tokenizer(checkpoint, meta, tmp)
        copy_generation_config(checkpoint, meta, tmp)
        if verify:
            _verify(tmp, meta, reader, torch_dtype)
    return out


# what a tokenizer's save_pretrained writes (transformers' fast and slow tokenizers, mtk's byte tokenizer): the
# only files an export takes from a checkpoint's tokenizer/ folder
TOKENIZER_FILES = re.compile(
    r"tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|added_tokens\.json|byte_tokenizer\.json"
    r"|chat_template\.(?:jinja|json)|vocab\.(?:json|txt)|merges\.txt|[\w.-]+\.(?:model|tiktoken)"
)


def copy_tokenizer(checkpoint: str | Path, meta: CheckpointMeta, out: Path) -> None:
    """The tokenizer files the run saved in the checkpoint, if any, into ``out``: only files the metadata lists
    (verified, inside the checkpoint) and a tokenizer writes (:data:`TOKENIZER_FILES`: no code, no scripts, no
    ``config.json`` in place of the one the export wrote), and never an ``auto_map`` that would make a loader run
    code mtk did not write."""
    root = Path(checkpoint)
    tokenizer = CheckpointPaths(root).tokenizer.name
    names = meta.files or {f"{tokenizer}/{name}": {} for name in list_files(root / tokenizer)}  # format 1: unlisted
    for name in sorted(names):
        if not name.startswith(f"{tokenizer}/") or name.count("/") != 1:
            continue
        target = out / name.split("/", 1)[1]
        if not TOKENIZER_FILES.fullmatch(target.name) or target.exists():  # the export's own files stay its own
            continue
        shutil.copy2(contained(root, name), target)
        if target.suffix == ".json":
            drop_auto_map(target)


def copy_generation_config(checkpoint: str | Path, meta: CheckpointMeta, out: Path) -> None:
    """The run's ``generation_config.json`` (eos ids, sampling defaults), where the checkpoint lists one (saves
    before it recorded none: the export goes without, as it did)."""
    if GENERATION_CONFIG_NAME in meta.files:
        shutil.copy2(checked_generation_config(checkpoint, meta), out / GENERATION_CONFIG_NAME)


def checked_generation_config(checkpoint: str | Path, meta: CheckpointMeta) -> Path:
    """The checkpoint's ``generation_config.json``, checked as a model directory's is: one transformers cannot load
    (a crafted file, its checksum rewritten with it) is one line, not transformers' traceback in the export's
    reload."""
    source = contained(Path(checkpoint), GENERATION_CONFIG_NAME)
    generation_config_of(source.parent)
    return source


def drop_auto_map(path: Path) -> None:
    """Remove ``auto_map`` (custom code to import) from a config or tokenizer config JSON written by an export."""
    try:
        record = jsonio.read(path)
    except (OSError, ValueError):
        return
    if isinstance(record, dict) and "auto_map" in record:
        del record["auto_map"]
        path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def check_new_directory(out: Path, source: str | Path | None = None) -> None:
    """``out`` is somewhere an export may create: not a file, not a link, not a non-empty directory, and not
    inside the checkpoint it reads (which would then no longer verify)."""
    refuse_link(out, "export into a new directory")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} is a file; export into a new directory")
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} already exists and is not empty; export into a new directory")
    if source is not None and out.resolve().is_relative_to(Path(source).resolve()):
        raise CheckpointError(f"{out} is inside the checkpoint {source}; export into a directory outside it")
    check_writable_beside(out)


def check_writable_beside(out: Path) -> None:
    """Refuse now (one line) a target whose folder cannot be written, not after the work meant to fill it: a probe
    directory is made and removed in the nearest folder of ``out``'s path that exists (a read-only file system, a
    path under a file, a folder without write permission for this user)."""
    ancestor = out.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".probe", dir=ancestor))
    except OSError as err:
        raise CheckpointError(
            f"cannot write {out}: {err.strerror or err} in {ancestor}; choose a writable directory"
        ) from None


def _umask() -> int:
    """This process's umask, read without changing it where Linux says it (setting it, even briefly, would race
    with the threads that write files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def staged_directory(out: Path) -> Iterator[Path]:
    """A fresh ``<out>.<random>.incomplete`` beside ``out`` to write into, renamed to ``out`` when the block
    succeeds and removed when it fails; an existing ``<out>.incomplete`` (anyone's) is never touched."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.", suffix=".incomplete", dir=out.parent))
        tmp.chmod(0o777 & ~_umask())  # mkdtemp's is private (0700); the export is a directory like mkdir's
    except OSError as err:
        raise CheckpointError(f"cannot write {out}: {err.strerror or err}; choose a writable directory") from None
    try:
        yield tmp
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = storage_reason(err)
        if reason is not None:
            raise CheckpointError(
                f"cannot write {out}: {reason}; nothing was written (free space or choose another directory)"
            ) from None
        raise
    for written in tmp.rglob("*"):  # files as open() makes them (some writers' are private, 0600)
        if written.is_file() and not written.is_symlink():
            written.chmod(0o666 & ~_umask())
    fsync_tree(tmp)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    fsync_dir(out.parent)
