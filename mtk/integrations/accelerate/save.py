"""The HF idiom ``unwrap_model(model).save_pretrained(dir, state_dict=accelerator.get_state_dict(model))``, made safe.

transformers' ``save_pretrained`` (and accelerate's ``save_model``) clean the target folder of weight shards
they would not rewrite, so saving into a folder that holds a user's ``model-00001-of-00003.safetensors`` deletes
it, and a target that is a file saves nothing without failing. Here the target must be new or empty (checked
before the run trains, see :func:`check_target`), the directory is written beside it under a staging name and
renamed into place when complete, and whatever goes wrong is one line on every rank.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from mtk.checkpoint.export import check_new_directory, staged_directory
from mtk.errors import CheckpointError, MtkError
from mtk.parallel.record import hf_model

__all__ = ["check_no_shards_to_clean", "check_target", "save_pretrained"]


def check_target(directory: str | Path, output_dir: str | Path | None = None, accelerator: Any = None) -> None:
    """Refuse (one line) a save target that is a file, a link, a folder that already holds files or one this user
    cannot write; and, given the run's ``output_dir``, that folder itself or a ``step_N``/``runs`` in it: it is new
    and empty before the run, but the run's own checkpoints and logs fill it, so the save would fail only after the
    whole run had trained. With ``accelerator``: checked by the main process, which writes (a path only its node
    has), and raised on every rank (collective)."""
    if accelerator is not None:
        _on_main_process(accelerator, lambda: check_target(directory, output_dir))
        return
    out = Path(directory)
    if output_dir is not None:
        runs = Path(output_dir).resolve()
        target = out.resolve()
        inside = target.relative_to(runs).parts if target.is_relative_to(runs) else None
        if inside is not None and (not inside or inside[0] == "runs" or re.match(r"step_\d+", inside[0])):
            raise CheckpointError(
                f"--save_model {out} is where the run writes its own checkpoints or logs (--output_dir "
                f"{output_dir}); name a directory outside them, e.g. {Path(output_dir) / 'final'}"
            )
    check_new_directory(out)


# transformers' save_pretrained removes a file in its target whose name is a weight shard's it will not rewrite
_SHARD = re.compile(r"(?:model|pytorch_model|adapter_model)-\d{5}-of-\d{5}\.(?:safetensors|bin)")


def check_no_shards_to_clean(directory: str | Path) -> None:
    """For a script that calls transformers' own ``save_pretrained`` into ``directory`` (classify.py, as the HF
    idiom goes): refuse, before training, a folder holding weight shards that save would delete as stale.

    Files the same save rewrites (``config.json``, ``model.safetensors``) are its own output from an earlier run;
    a ``model-00001-of-00003.safetensors`` it does not write is someone's model, removed without a word.
    """
    out = Path(directory)
    if not out.is_dir():
        return
    shards = sorted(path.name for path in out.iterdir() if path.is_file() and _SHARD.fullmatch(path.name))
    if shards:
        raise CheckpointError(
            f"{out} holds weight shards ({', '.join(shards[:3])}{', ...' if len(shards) > 3 else ''}) that "
            f"transformers' save_pretrained would delete when the run saves its model there; move them, or use "
            f"another --output_dir"
        )


def save_pretrained(accelerator: Any, model: nn.Module, directory: str | Path, tokenizer: Any = None) -> Path:
    """Write the whole model (the main process gathers it; adapters only for a PEFT model) and ``tokenizer`` as
    an HF directory at ``directory``, atomically. Collective: every rank calls it and every rank raises the same
    error if the write fails."""
    out = Path(directory)
    check_target(out, accelerator=accelerator)  # the writer's view, before any rank gathers
    state = accelerator.get_state_dict(model)  # collective

    def write() -> None:
        with staged_directory(out) as tmp, generation_config_as_set(accelerator.unwrap_model(model)):
            accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state, safe_serialization=True)
            if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(tmp)

    _on_main_process(accelerator, write)
    return out


@contextlib.contextmanager
def generation_config_as_set(model: nn.Module) -> Iterator[None]:
    """``model``'s generation config written as it is set while ``save_pretrained`` runs: transformers' save validates
    it strictly and refuses a greedy config that names a temperature or top_p (``do_sample`` false beside them),
    which loading only warns of and many published models ship; the run would have trained to its end and then
    saved no model (mtk's checkpoints write it the same way)."""
    hf: Any = hf_model(model)
    generation = getattr(hf, "generation_config", None)
    if generation is None:
        yield
        return
    hf.generation_config = _WrittenAsSet(generation)  # (save_pretrained only calls its save_pretrained)
    try:
        yield
    finally:
        hf.generation_config = generation


class _WrittenAsSet:
    def __init__(self, generation: Any) -> None:
        self.generation = generation

    def save_pretrained(self, directory: str | Path, *args: Any, **kwargs: Any) -> None:
        self.generation.to_json_file(str(Path(directory) / "generation_config.json"))


def _on_main_process(accelerator: Any, job: Callable[[], None]) -> None:
    """Run ``job`` on the main process (the one that writes) and raise its error on every rank (collective), so no
    rank waits in a collective another left (a folder only some nodes can see or write). An error that is not
    mtk's (a bug, PEFT's) keeps its traceback on the main process; the others say where it is."""
    problem: list[str | None] = [None]
    failed: Exception | None = None
    if accelerator.is_main_process:
        try:
            job()
        except Exception as err:  # (every kind: the other ranks would wait in the broadcast below until timeout)
            failed = err
            problem = [str(err) if isinstance(err, MtkError) else f"the main process failed to write: {err!r}"]
    if dist.is_initialized():
        dist.broadcast_object_list(problem, src=0)  # rank 0 of the world is accelerate's main process
    if failed is not None:
        raise failed
    if problem[0] is not None:
        raise CheckpointError(problem[0])
