"""Export an adapter-only (LoRA) checkpoint, at any layout, offline: a PEFT adapter directory, or the merged model.

``--adapter``: each adapter tensor is merged from its shards, named as PEFT names it (PEFT's own
``get_peft_model_state_dict`` on the model built on the meta device from the checkpoint's config), and written
as ``adapter_model.safetensors`` beside PEFT's ``adapter_config.json``: ``PeftModel.from_pretrained(base, out)``
loads it. ``--merge``: the base HF directory (``--base``, else the directory the run loaded) is checked against
the checkpoint's fingerprint of it, the adapter applied with PEFT and merged (``merge_and_unload``), and the
result saved with ``save_pretrained``. Both write into a staged directory renamed when complete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

from mtk.checkpoint.base_model import differs, fingerprint
from mtk.checkpoint.export import (
    check_new_directory,
    copy_generation_config,
    copy_tokenizer,
    drop_auto_map,
    staged_directory,
)
from mtk.checkpoint.hf_load import safetensors_index
from mtk.checkpoint.integrity import read_verified
from mtk.checkpoint.meta import CheckpointMeta
from mtk.checkpoint.reader import ShardedCheckpointReader
from mtk.errors import CheckpointError
from mtk.models import DTYPES, resolve_config

__all__ = ["export_adapter", "export_merged"]

ADAPTER_FILE = "adapter_model.safetensors"


def _adapter_meta(checkpoint: str | Path) -> CheckpointMeta:
    meta = read_verified(checkpoint)
    if meta.base_model is None or not meta.model.get("adapters"):
        raise CheckpointError(
            f"{checkpoint} holds a full model, not LoRA adapters; export it without --adapter or --merge"
        )
    return meta


def _hf_class(meta: CheckpointMeta):
    cls = getattr(transformers, meta.model["class"], None)
    if cls is None:
        raise CheckpointError(f"the checkpoint's model class {meta.model['class']!r} is not in transformers")
    return cls


def _meta_peft_model(meta: CheckpointMeta) -> Any:
    """The PeftModel the run trained, on the meta device (names and configs only, no memory)."""
    import peft

    config = transformers.AutoConfig.for_model(**meta.model["config"])
    with torch.device("meta"):
        base = _hf_class(meta)._from_config(config)
    model = None
    for name, record in meta.model["adapters"].items():
        adapter_config = peft.LoraConfig(**{k: v for k, v in record.items() if k not in ("peft_type",)})
        if model is None:
            model = peft.get_peft_model(base, adapter_config, adapter_name=name)
        else:
            model.add_adapter(name, adapter_config)
        model.peft_config[name].base_model_name_or_path = record.get("base_model_name_or_path")
    return model


def _write_adapters(
    checkpoint: str | Path, meta: CheckpointMeta, out: Path, verify: bool, dtype: str | None = None
) -> None:
    from peft import get_peft_model_state_dict

    model = _meta_peft_model(meta)
    with ShardedCheckpointReader(checkpoint, meta) as reader:
        reader.check_complete(optimizer=False)  # (as export_checkpoint)
        reader.check_replicas_agree(optimizer=False)
        full = {name: reader.full(name) for name in reader.names()}  # adapters only: small
    for name, config in model.peft_config.items():
        target = out if name == "default" else out / name  # PEFT's layout for several adapters
        target.mkdir(parents=True, exist_ok=True)
        expected = get_peft_model_state_dict(model, adapter_name=name)  # PEFT's names for this adapter
        tensors = get_peft_model_state_dict(model, state_dict=full, adapter_name=name)
        if sorted(tensors) != sorted(expected):
            missing = sorted(set(expected) - set(tensors))[:3]
            raise CheckpointError(f"{checkpoint}: adapter {name!r} lacks {missing}; it is not this model's checkpoint")
        if dtype is not None:  # (--dtype: the adapters' floating-point tensors cast, as a full export's weights)
            tensors = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in tensors.items()}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(target / ADAPTER_FILE), {"format": "pt"})
        config.save_pretrained(str(target))
        if verify:
            reloaded = load_file(str(target / ADAPTER_FILE))
            if sorted(reloaded) != sorted(tensors) or any(not torch.equal(reloaded[k], tensors[k]) for k in tensors):
                raise CheckpointError(f"verification failed: {target / ADAPTER_FILE} differs from the checkpoint")


def export_adapter(
    checkpoint: str | Path, out_dir: str | Path, *, dtype: str | None = None, verify: bool = True
) -> Path:
    """A PEFT adapter directory from an adapter-only checkpoint (floating-point tensors cast to ``dtype``); returns
    it."""
    meta = _adapter_meta(checkpoint)
    out = Path(out_dir)
    check_new_directory(out, checkpoint)
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    with staged_directory(out) as tmp:
        _write_adapters(checkpoint, meta, tmp, verify, dtype)
        copy_tokenizer(checkpoint, meta, tmp)
    return out


def _base_directory(meta: CheckpointMeta, base: str | Path | None) -> Path:
    recorded = (meta.base_model or {}).get("name_or_path", "")
    directory = Path(base) if base else Path(recorded) if recorded and Path(recorded).is_dir() else None
    if directory is None:
        raise CheckpointError(
            f"the adapters were trained on {recorded!r}, not a directory here: pass --base DIR (the base HF model)"
        )
    if not directory.is_dir():
        raise CheckpointError(f"--base {directory} is not a directory")
    safetensors_index(directory)  # a model directory's own checks: safetensors only, every shard inside it
    return directory


# what decides a base's architecture and sizes: a base that differs in one is another model (and building the
# checkpoint's class from another family's config took that class's default sizes: a 7B Llama from GPT-2's)
_SHAPE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size")


def _check_base_config(meta: CheckpointMeta, directory: Path, checkpoint: str | Path) -> None:
    """One line, before any weight is read, when ``directory``'s config is not the one the adapters trained on."""
    recorded = meta.model.get("config") or {}
    found = resolve_config(str(directory)).to_dict()
    fields = [k for k in _SHAPE_FIELDS if k in recorded and k in found and found[k] != recorded[k]]
    differ = [f"{k} {found[k]} there, {recorded[k]} trained" for k in fields]
    if differ:
        raise CheckpointError(
            f"{directory} is not the base the adapters in {checkpoint} were trained on (its config differs: "
            f"{'; '.join(differ)}); pass --base the directory the run loaded"
        )


def export_merged(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    base: str | Path | None = None,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    verify: bool = True,
) -> Path:
    """The base HF model with the checkpoint's adapters merged in, as an HF directory; returns it."""
    from peft import PeftModel

    meta = _adapter_meta(checkpoint)
    out = Path(out_dir)
    check_new_directory(out, checkpoint)
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    directory = _base_directory(meta, base)
    _check_base_config(meta, directory, checkpoint)
    try:
        model = _hf_class(meta).from_pretrained(directory, dtype=torch.float32, use_safetensors=True)
    except OSError as err:  # transformers' word for a directory it cannot read a model from
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"--base {directory}: transformers cannot load it ({first})") from None
    assert meta.base_model is not None
    if differs(meta.base_model["fingerprint"], fingerprint(model)):
        raise CheckpointError(
            f"{directory} is not the base the adapters in {checkpoint} were trained on "
            f"({meta.base_model['name_or_path']!r}; the weights' fingerprint differs)"
        )
    with staged_directory(out) as tmp:
        adapter_dir = tmp / "adapter"
        _write_adapters(checkpoint, meta, adapter_dir, verify)
        merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
        if dtype is not None:
            merged = merged.to(DTYPES[dtype])
        for file in sorted(adapter_dir.rglob("*"), reverse=True):
            file.unlink() if file.is_file() else file.rmdir()
        adapter_dir.rmdir()
        merged.save_pretrained(tmp, max_shard_size=max_shard_size)
        drop_auto_map(tmp / "config.json")
        copy_tokenizer(checkpoint, meta, tmp)
        copy_generation_config(checkpoint, meta, tmp)  # the run's, over the base's
        if verify:
            reloaded = _hf_class(meta).from_pretrained(tmp, dtype=DTYPES[dtype] if dtype else torch.float32)
            state, expected = reloaded.state_dict(), merged.state_dict()
            for name, tensor in expected.items():
                if name not in state or not torch.equal(state[name], tensor):
                    raise CheckpointError(f"verification failed: {name} reloaded from {out} differs from the merge")
    return out
