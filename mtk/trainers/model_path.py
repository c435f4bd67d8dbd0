"""``model=`` a local HF directory in mtk's TRL trainers: each rank reads only its own slices of the weights.

TRL loads a model given by path with ``create_model_from_path`` (``from_pretrained``: the whole model on every
process) inside its trainer's ``__init__``, before the Trainer builds its accelerator. mtk's TRL trainers give TRL a
:class:`PathLoader` in its place for that one call. Before the accelerator exists it returns the directory's model
with its parameters on the meta device, nothing read (:func:`~mtk.checkpoint.hf_load.empty_model`); TRL sets its
pad and eos tokens on the config as usual, and :class:`~mtk.trainers.base.ParallelTrainerMixin`, where it converts
the model, reads this rank's slices into it (``mtk.Accelerator.parallelize(model, checkpoint=directory)``). DPO's
reference model, which TRL builds from the policy's directory once the accelerator exists, is built, converted and
read the same way at once (or from ``ref_model=`` a directory: :func:`take_reference_directory`).

``args.model_init_kwargs`` keep TRL's meaning where mtk can honour them (:func:`model_init`); any other key is one
line naming it, and so is a hub id: mtk reads local directories and downloads nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from mtk.checkpoint.hf_load import empty_model, safetensors_index
from mtk.checkpoint.safetensors_slices import open_safetensors
from mtk.errors import ConfigError
from mtk.models import resolve_config

__all__ = ["ModelInit", "PathLoader", "local_directory", "model_init", "take_reference_directory", "trl_loading"]

TRL_DTYPES = ("bfloat16", "float16", "float32")  # the strings TRL's create_model_from_path turns into dtypes
HONOURED = "dtype, attn_implementation, trust_remote_code, device_map=None, revision=None and config attributes"


@dataclass(frozen=True)
class ModelInit:
    """What ``model_init_kwargs`` ask of the model, as :func:`~mtk.checkpoint.hf_load.empty_model` builds it."""

    dtype: torch.dtype
    attn_implementation: str | None
    config: PretrainedConfig  # the directory's, with the keys that name config attributes set (as from_pretrained)


def local_directory(model_id: str) -> Path:
    """``model_id`` as a local directory; a hub id (or a missing path) is one line: nothing is downloaded."""
    directory = Path(model_id)
    if not directory.is_dir():
        raise ConfigError(
            f"model={model_id!r} is not a local directory: mtk's trainers read each rank's slices from a local HF "
            f"directory and download nothing; download it first (hf download {model_id} --local-dir DIR) and pass "
            "model='DIR'"
        )
    return directory


def model_init(directory: Path, kwargs: dict[str, Any]) -> ModelInit:
    """TRL's ``create_model_from_path`` arguments for ``directory``, as mtk honours them: ``dtype`` (TRL's default
    float32; a dtype, one of TRL's strings, ``"auto"`` for the checkpoint's, ``None`` for torch's default),
    ``attn_implementation``, keys naming config attributes (``use_cache=False``: set on the config, as
    ``from_pretrained`` does), ``device_map=None`` and ``revision=None`` (what TRL may add), ``trust_remote_code``
    (mtk runs no code from a model directory: a directory naming its own code is refused). Others: one line."""
    remaining = dict(kwargs)
    config = resolve_config(str(directory))  # one line for pickled weights or a config that needs its own code
    if remaining.pop("trust_remote_code", False) and getattr(config, "auto_map", None):
        raise ConfigError(
            f"model_init_kwargs['trust_remote_code']=True: {directory} names its own code (auto_map), and mtk runs "
            "no code from a model directory; leave trust_remote_code off to train the class transformers ships"
        )
    unset = {"device_map": "mtk puts each rank's slices on its own device", "revision": "a local directory has one"}
    for key, why in unset.items():
        if remaining.pop(key, None) is not None:
            raise ConfigError(
                f"model_init_kwargs[{key!r}]={kwargs[key]!r} with model={str(directory)!r}: {why}; leave it unset"
            )
    dtype = _dtype(remaining.pop("dtype", "float32"), directory, config)
    attn_implementation = remaining.pop("attn_implementation", None)
    attributes = config.to_dict()
    for key in remaining:
        if key not in attributes:
            raise ConfigError(
                f"model_init_kwargs[{key!r}] with model= a directory: mtk builds the model itself, reading only this "
                f"rank's slices, and cannot honour it; it honours {HONOURED}"
            )
    for key, value in remaining.items():
        setattr(config, key, value)
    return ModelInit(dtype, attn_implementation, config)


def _dtype(value: Any, directory: Path, config: PretrainedConfig) -> torch.dtype:
    """The dtype TRL's ``create_model_from_path`` and ``from_pretrained`` would load ``directory`` in."""
    if isinstance(value, torch.dtype):
        return value
    if value is None:
        return torch.get_default_dtype()
    if value in TRL_DTYPES:
        return getattr(torch, value)
    if value == "auto":  # the config's, else the saved weights' (their first floating tensor's)
        configured = getattr(config, "dtype", None)
        if isinstance(configured, torch.dtype):
            return configured
        for name, path in safetensors_index(directory).items():
            with open_safetensors(path) as handle:
                saved = handle.get_slice(name).dtype
            if saved.is_floating_point:
                return saved
        return torch.get_default_dtype()
    raise ConfigError(
        f"model_init_kwargs['dtype']={value!r}: use a torch.dtype, 'auto' or one of {', '.join(TRL_DTYPES)}"
    )


def _build(directory: Path, kwargs: dict[str, Any]) -> nn.Module:
    init = model_init(directory, kwargs)
    return empty_model(directory, dtype=init.dtype, attn_implementation=init.attn_implementation, config=init.config)


class PathLoader:
    """TRL's ``create_model_from_path`` for one mtk trainer (see the module docstring).

    ``unread`` is the policy built on the meta device and its directory, until the trainer reads it;
    ``reference`` is the directory of DPO's reference when one was given (``ref_model=`` a path)."""

    def __init__(self, trainer: Any, trl_loader: Callable[..., nn.Module], reference: Path | None = None) -> None:
        self.trainer, self.trl_loader, self.reference = trainer, trl_loader, reference
        self.unread: tuple[nn.Module, Path] | None = None

    def __call__(self, model_id: str, **kwargs: Any) -> nn.Module:
        accelerator = getattr(self.trainer, "accelerator", None)
        if accelerator is None:  # the policy, before the Trainer builds the accelerator
            directory = local_directory(model_id)
            model = _build(directory, kwargs)
            self.unread = (model, directory)
            return model
        # DPO's reference, built by TRL after the accelerator (from the policy's directory unless one was given)
        source = self.reference or (Path(model_id) if model_id and Path(model_id).is_dir() else None)
        if source is None:  # a policy given as a model named by a hub id (or by nothing): TRL's own load
            return self.trl_loader(model_id, **kwargs)
        return accelerator.parallelize(_build(source, kwargs), checkpoint=source)

    def take_unread(self, model: Any) -> Path | None:
        """The directory ``model`` is still to be read from (once: the caller reads it)."""
        if self.unread is None or self.unread[0] is not model:
            return None
        directory = self.unread[1]
        self.unread = None
        return directory


def take_reference_directory(args: list, kwargs: dict[str, Any], peft_config: Any) -> Path | None:
    """DPO's ``ref_model=`` a local directory (TRL takes a model there), replaced by ``None`` in what TRL sees: TRL
    then builds its reference through ``create_model_from_path``, which :class:`PathLoader` reads from there."""
    positional = len(args) > 1
    given = args[1] if positional else kwargs.get("ref_model")
    if not isinstance(given, (str, Path)):
        return None
    if peft_config is not None:
        raise ConfigError(
            "DPOTrainer(ref_model=<a directory>, peft_config=...): with adapters the reference is the model with its "
            "adapters disabled (as TRL's own LoRA run); leave ref_model unset"
        )
    if positional:
        args[1] = None
    else:
        kwargs["ref_model"] = None
    return local_directory(str(given))


@contextlib.contextmanager
def trl_loading(module: Any, loader: PathLoader) -> Iterator[None]:
    """TRL's trainer ``module`` (``trl.trainer.sft_trainer``, ``dpo_trainer``) builds models given by path with
    ``loader`` while the block runs (its trainer's ``__init__``): TRL calls ``create_model_from_path`` by that
    module-level name, with no hook to pass another."""
    saved = module.create_model_from_path
    module.create_model_from_path = loader
    try:
        yield
    finally:
        module.create_model_from_path = saved
