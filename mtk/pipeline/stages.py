"""Cut an HF decoder into pipeline stages, in place, by the rule set's :class:`~mtk.rules.base.PipelineSpec`.

Every stage keeps the HF model object and runs HF's own forward: the decoder blocks of other stages
become :class:`SkipLayer` pass-throughs (the ``ModuleList`` keeps its length, so per-layer config
such as sliding-window layer types still lines up), and the modules only the first or last stage
runs are replaced on the others. Parameters keep their HF names, so checkpoints of different
stages are disjoint pieces of one state dict.

An input embedding tied to the LM head is split between the first and the last stage: each holds a
copy, marked ``pipeline_tied`` in its :class:`~mtk.parallel.parameters.ParamInfo`; the gradients of
the two copies are summed over the embedding group before the optimizer step
(:class:`~mtk.pipeline.engine.PipelineModel`), so they stay equal.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from mtk.parallel.parameters import set_param_info
from mtk.parallel.state import ParallelState
from mtk.pipeline.balance import layer_counts
from mtk.rules.base import IDENTITY, REMOVE, ZEROS, RuleSet, UnsupportedModelError, compile_pattern

__all__ = ["SkipLayer", "StageInfo", "split_stages", "swapped"]


class SkipLayer(nn.Module):
    """A decoder block that runs on another stage: hidden states pass through unchanged."""

    def __init__(self, index: int, stage: int) -> None:
        super().__init__()
        self.index, self.stage = index, stage

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states

    def extra_repr(self) -> str:
        return f"layer {self.index} runs on pipeline stage {self.stage}"


class PassThrough(nn.Module):
    """The final norm before the last stage, or embedding dropout after the first: returns its input."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


class ZeroEmbedding(nn.Module):
    """Learned positions on stages after the first: the first stage already added them."""

    def __init__(self, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embedding_dim, self.dtype = embedding_dim, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.embedding_dim, dtype=self.dtype, device=ids.device)  # [*ids, dim]


class OnOtherStage(nn.Module):
    """A module owned by another stage; calling it here is a bug in the stage glue, said plainly."""

    def __init__(self, name: str, stage: str) -> None:
        super().__init__()
        self.name, self.stage = name, stage

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} runs on the {self.stage} pipeline stage only")


@dataclass(frozen=True)
class StageInfo:
    """What this rank's stage holds.

    Attributes:
        stage, num_stages: this rank's index and the pipeline depth.
        chunks: the decoder blocks of each model chunk this rank runs, in order (one chunk, unless the
            interleaved schedule gives the rank ``v`` non-adjacent ones: chunk ``c`` is the model's
            ``c * num_stages + stage``-th).
        tied: names of this stage's copies of an input embedding tied to the LM head (both ends).
        layers_name: the ``ModuleList`` of decoder blocks; first_modules / last_modules: the modules
            only the model's first / last chunk runs, with what stands in for them elsewhere.
    """

    stage: int
    num_stages: int
    chunks: tuple[range, ...]
    tied: tuple[str, ...] = ()
    layers_name: str = ""
    first_modules: tuple[tuple[str, str], ...] = ()
    last_modules: tuple[tuple[str, str], ...] = ()

    @property
    def layers(self) -> tuple[int, ...]:
        """Every decoder block this rank runs."""
        return tuple(index for chunk in self.chunks for index in chunk)

    @property
    def virtual_stages(self) -> int:
        return len(self.chunks)

    @property
    def is_first(self) -> bool:
        """This rank holds the model's first chunk (the embeddings)."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """This rank holds the model's last chunk (the head and the loss)."""
        return self.stage == self.num_stages - 1

    def chunk_is_first(self, chunk: int) -> bool:
        return self.is_first and chunk == 0

    def chunk_is_last(self, chunk: int) -> bool:
        return self.is_last and chunk == self.virtual_stages - 1

    def chunk_view(self, model: nn.Module, chunk: int) -> dict[str, nn.Module]:
        """What ``model`` (this rank's HF model) must run as while one chunk of several runs: the rank's
        other blocks pass through, and the embeddings (the head and final norm) stand aside unless the
        chunk is the model's first (last). Empty with one chunk: the model as cut is that chunk."""
        if self.virtual_stages == 1:
            return {}
        view: dict[str, nn.Module] = {
            f"{self.layers_name}.{index}": SkipLayer(index, self.stage)
            for index in self.layers
            if index not in self.chunks[chunk]
        }
        for owner, modules, runs in (
            ("first", self.first_modules, not self.is_first or self.chunk_is_first(chunk)),
            ("last", self.last_modules, not self.is_last or self.chunk_is_last(chunk)),
        ):
            if not runs:
                for name, kind in modules:
                    view[name] = _replacement(kind, name, model.get_submodule(name), owner)
        return view


@contextmanager
def swapped(model: nn.Module, view: dict[str, nn.Module]) -> Iterator[None]:
    """``model`` with the modules ``view`` names replaced, restored on exit (autograd keeps what ran)."""
    kept = {name: model.get_submodule(name) for name in view}
    for name, module in view.items():
        model.set_submodule(name, module)
    try:
        yield
    finally:
        for name, module in kept.items():
            model.set_submodule(name, module)


def _find_layers(model: nn.Module, pattern: str) -> tuple[str, nn.ModuleList]:
    regex = compile_pattern(pattern)
    found = [(n, m) for n, m in model.named_modules() if n and regex.match(n) and isinstance(m, nn.ModuleList)]
    if len(found) != 1:
        raise UnsupportedModelError(
            f"{type(model).__name__}: the pipeline rule {pattern!r} must name one list of decoder blocks, "
            f"found {[n for n, _ in found]}"
        )
    return found[0]


def _replacement(kind: str, name: str, module: nn.Module, owner: str) -> nn.Module:
    if kind == IDENTITY:
        return PassThrough()
    if kind == ZEROS:
        if not isinstance(module, nn.Embedding):
            raise UnsupportedModelError(f"{name}: a zeros stage replacement needs an nn.Embedding")
        return ZeroEmbedding(module.embedding_dim, module.weight.dtype)
    assert kind == REMOVE
    return OnOtherStage(name, owner)


def split_stages(
    model: nn.Module,
    parallel: ParallelState,
    rule_set: RuleSet,
    layers_per_stage: tuple[int, ...] = (),
    virtual_stages: int = 1,
) -> StageInfo:
    """Keep only this rank's pipeline stage of ``model`` (in place); returns what the stage holds.

    ``layers_per_stage``: decoder blocks per stage, default :mod:`mtk.pipeline.balance`'s split (the last
    stage's LM head counted as layers). With ``virtual_stages = v`` the model is cut into ``pp * v`` chunks
    (``layers_per_stage``: one count per chunk) and this rank keeps chunks ``pp_rank, pp_rank + pp, ...``,
    each under its HF layer index.
    Works on a materialized model (other stages' weights are freed) and on one on the meta device
    (nothing is allocated; the loader then reads only this stage's tensors).
    """
    spec = rule_set.pipeline
    if spec is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}: the {rule_set.name} rules define no pipeline stages; pipeline parallelism "
            f"supports decoder LMs (Llama, Mistral, Qwen2/3, Phi-3, GPT-2); use pp = 1"
        )
    layers_name, layers = _find_layers(model, spec.layers)
    p = parallel.pp_size
    counts = layer_counts(cast(Any, model).config, p * virtual_stages, layers_per_stage)  # the default weighs the head
    if sum(counts) != len(layers):
        raise UnsupportedModelError(
            f"{type(model).__name__}: its config gives {sum(counts)} decoder layers, the model has {len(layers)}"
        )
    starts = [sum(counts[:k]) for k in range(len(counts))]
    chunks = tuple(
        range(starts[k], starts[k] + counts[k]) for k in range(parallel.pp_rank, len(counts), p)
    )  # model chunk k runs on rank k % p
    stage_of = [k % p for k, count in enumerate(counts) for _ in range(count)]

    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)

    replaced: dict[str, str] = {}  # module name -> "first" / "last" for modules another stage owns
    owned: dict[str, list[tuple[str, str]]] = {"first": [], "last": []}
    outside = [(n, m) for n, m in model.named_modules() if n and not (n + ".").startswith(layers_name + ".")]
    for owner, rules, keep in (
        ("first", spec.first_stage, parallel.is_first_stage),
        ("last", spec.last_stage, parallel.is_last_stage),
    ):
        for pattern, kind in rules:
            regex = compile_pattern(pattern)
            for name, module in outside:
                if regex.match(name) and not any(name.startswith(r + ".") for r in replaced):
                    replaced[name] = owner
                    owned[owner].append((name, kind))
                    if not keep:
                        model.set_submodule(name, _replacement(kind, name, module, owner))
    mine = {index for chunk in chunks for index in chunk}
    for index in range(len(layers)):
        if index not in mine:
            layers[index] = SkipLayer(index, stage_of[index])

    tied = _mark_tied_copies(model, names_of, replaced, parallel) if p > 1 else ()
    return StageInfo(parallel.pp_rank, p, chunks, tied, layers_name, tuple(owned["first"]), tuple(owned["last"]))


def _mark_tied_copies(
    model: nn.Module, names_of: dict[int, list[str]], replaced: dict[str, str], parallel: ParallelState
) -> tuple[str, ...]:
    """Mark the first and last stages' copies of a parameter shared by first- and last-stage modules.

    The last stage's copy is a duplicate: gradient norms count it once (on the first stage), and
    checkpoints know it as the first stage's name (``ParamInfo.tied_to``).
    """
    tied = []
    for name, param in model.named_parameters():
        owners = {
            owner
            for full_name in names_of.get(id(param), [name])
            for module_name, owner in replaced.items()
            if full_name.startswith(module_name + ".")
        }
        if owners == {"first", "last"}:
            first_name = next(n for n in names_of[id(param)] if replaced.get(n.rpartition(".")[0]) == "first")
            # tied_to: the name it is stored under in a one-stage model
            set_param_info(
                param, pipeline_tied=True, tied_to=first_name, pipeline_duplicate=not parallel.is_first_stage
            )
            tied.append(name)
    return tuple(tied)
