"""PEFT's ``get_peft_model`` on a model :func:`~mtk.convert.parallelize` made tensor/pipeline parallel.

PEFT does not know mtk's layers; :func:`get_peft_model` teaches it (``LoraConfig._register_custom_module``:
:class:`~mtk.lora.layers.ParallelLoraLinear` for every column- and row-parallel linear), resolves the targets
against the parallel model first (``all-linear``, targets that match nothing or a layer mtk keeps whole: one
clear line each) and then calls PEFT's own ``get_peft_model``. The result is an ordinary ``PeftModel``:
``print_trainable_parameters``, ``disable_adapter``, ``merge_adapter``/``unmerge_adapter`` and ``save_pretrained``
(of the Accelerator's gathered state dict) work as PEFT documents.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from mtk.errors import ConfigError
from mtk.models import whole_parameters
from mtk.parallel.layers import ColumnParallelLinear, RowParallelLinear, ShardedModule
from mtk.parallel.record import adapter_configs, hf_model, is_peft_model, parallelized

__all__ = ["adapter_configs", "get_peft_model", "hf_model", "is_peft_model", "split_linear_names", "whole_peft_model"]

ALL_LINEAR = "all-linear"


def split_linear_names(model: nn.Module) -> dict[str, nn.Module]:
    """The model's tensor-parallel linears by HF name, without the (vocabulary-parallel) output head."""
    head = cast(Any, model).get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module is not head
    }


def _linear_kind(module: nn.Module) -> str | None:
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return "split"
    if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
        return "whole"
    return None


def _check_target_parameters(model: nn.Module, config: Any) -> None:
    """PEFT's ``target_parameters`` (LoRA on 3D expert tensors) naming no parameter: one line (PEFT's own error is a
    traceback). Tensors EP spread or TP split take factors spread with their experts (:mod:`mtk.lora.experts`)."""
    targets = list(getattr(config, "target_parameters", None) or ())
    names = [name for name, _ in model.named_parameters()]
    unmatched = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    record = parallelized(model)
    if unmatched and record is not None and record.stage is not None:  # another stage's: the whole model's names
        hf: Any = hf_model(model)
        with torch.device("meta"), whole_parameters():
            names = [name for name, _ in type(hf)._from_config(hf.config).named_parameters()]
        unmatched = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if unmatched:
        raise ConfigError(
            f"LoRA target_parameters {', '.join(unmatched)} match no parameter; name a parameter as "
            "named_parameters() does, e.g. mlp.experts.gate_up_proj"
        )


def _resolve_targets(model: nn.Module, config: Any, report) -> Any:
    """``config`` with ``all-linear`` spelt out as mtk's split linears; every target checked (one line each)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    _check_target_parameters(model, config)
    if getattr(config, "target_parameters", None):
        report(f"mtk: LoRA on the tensors {', '.join(config.target_parameters)} (PEFT's target_parameters)")
    config = copy.deepcopy(config)
    if getattr(config, "target_parameters", None) and not config.target_modules:
        _refuse_split_modules_to_save(model, config)
        return config  # PEFT's parameter targets alone (their names checked above)
    record = parallelized(model)
    split = split_linear_names(model)
    suffixes = sorted(_on_every_stage({name.rpartition(".")[2] for name in split}, record))
    if isinstance(config.target_modules, str) and config.target_modules.lower() == ALL_LINEAR:
        whole = sorted(_on_every_stage({n for n, m in model.named_modules() if _linear_kind(m) == "whole"}, record))
        config.target_modules = set(suffixes)
        # a whole linear sharing a split one's name (BERT's pooler.dense): excluded by its full name
        clashes = [n for n in whole if n.rpartition(".")[2] in config.target_modules]
        if clashes:
            config.exclude_modules = sorted({*(config.exclude_modules or ()), *clashes})
        left_out = f"; kept whole, not adapted: {', '.join(whole)}" if whole else ""
        report(f"mtk: LoRA all-linear = the tensor-parallel linears {', '.join(suffixes)}{left_out}")
    targets = [] if isinstance(config.target_modules, str) else sorted(config.target_modules)
    shown = config.target_modules if isinstance(config.target_modules, str) else ",".join(targets)
    valid = f"LoRA adapts the tensor-parallel linears {', '.join(suffixes)} (or all-linear)"
    stage = record.stage if record else None
    if getattr(config, "layer_replication", None):
        raise ConfigError(
            "LoRA layer_replication is not supported by mtk: PEFT copies decoder layers that share their base "
            "weights, which tensor-parallel layers cannot be copied as (nor merged exports hold); leave it unset"
        )
    # (PEFT answers True for a list's match and an re.Match for a regular expression's)
    matched = [(n, m) for n, m in model.named_modules() if n and check_target_module_exists(config, n)]
    if not matched:
        where = f" on pipeline stage {stage.stage}" if stage else ""
        raise ConfigError(f"LoRA targets {shown} match no module{where}; {valid}")
    head = cast(Any, model).get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, module in matched:
        if _linear_kind(module) == "split" and module is not head:
            continue
        train_whole = ""
        if module is head:
            what = "the vocabulary-parallel output head"
        elif _linear_kind(module) == "whole":
            what = f"a {type(module).__name__} mtk keeps whole (replicated over TP)"
            train_whole = "; to train it, name it in a PEFT config's modules_to_save instead"
        else:
            what = f"a {type(module).__name__}, not a linear layer"
        raise ConfigError(f"LoRA target {name} is {what}: leave it out of the targets; {valid}{train_whole}")
    names = [n for n, _ in matched]
    unmatched = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if unmatched and stage is None:  # with pp > 1 a target may live on another stage
        raise ConfigError(f"LoRA target(s) {', '.join(unmatched)} match no module; {valid}")
    _refuse_split_modules_to_save(model, config)
    return config


def _on_every_stage(names: set[str], record: Any) -> set[str]:
    """``names`` of every pipeline stage's modules (collective at pp > 1): the stages of a model whose layers differ
    (a hybrid's attention kinds, MoE layers after dense ones) hold different linears, and the main process's
    ``all-linear`` alone, saved as the adapters' config, would leave the other stages' adapters unloaded."""
    if record is None or record.stage is None or record.pp_size == 1 or not dist.is_initialized():
        return names
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(names))
    return set().union(*gathered)


def _refuse_split_modules_to_save(model: nn.Module, config: Any) -> None:
    """PEFT copies ``modules_to_save`` whole: mtk's layer hooks would not follow a split one (one line)."""
    for name, module in model.named_modules():
        saved = [m for m in (config.modules_to_save or ()) if name == m or name.endswith(f".{m}")]
        if saved and isinstance(module, ShardedModule):
            raise ConfigError(
                f"modules_to_save {saved[0]}: {name} is a tensor-parallel {type(module).__name__}; only modules mtk "
                "keeps whole (a classifier head, a norm) can be trained next to the adapters"
            )


def _seed(device: torch.device) -> int:
    """Rank 0's seed (what ``set_seed`` set), on every rank: adapters start equal wherever they live."""
    seed = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.broadcast(seed, src=0)
    return int(seed.item())


def get_peft_model(
    model: nn.Module,
    config: Any,
    adapter_name: str = "default",
    report=print,
    autocast_adapter_dtype: bool = True,
) -> nn.Module:
    """``peft.get_peft_model`` for a model mtk made parallel (its stage, with pp > 1); returns the ``PeftModel``.

    Only LoRA (``LoraConfig``) is supported. Call it on every rank, after :func:`~mtk.convert.parallelize` (or
    ``load_pretrained_tp``) and before building the optimizer; the Accelerator's ``prepare`` takes the result.
    ``autocast_adapter_dtype`` is PEFT's: adapters on a half-precision base are kept in fp32 (False: in the
    base's dtype, as TRL asks under ZeRO-3).
    """
    import peft  # PEFT (and mtk's layers built on it) load only when a run asks for LoRA: ~1-2 s of start-up

    from mtk.lora.experts import draw_expert_factors
    from mtk.lora.layers import SEED_ATTRIBUTE, ParallelLoraLinear

    record = parallelized(model)
    if record is None:
        raise ConfigError(
            "mtk.lora.get_peft_model needs the parallel model: call accelerator.parallelize(model) (or "
            "load_pretrained_tp) first, then add the adapters"
        )
    if not isinstance(config, peft.LoraConfig):
        raise ConfigError(f"{type(config).__name__}: mtk shards LoRA adapters only; use peft.LoraConfig")
    config = _resolve_targets(model, config, report)
    setattr(config, SEED_ATTRIBUTE, _seed(record.rng.device if record.rng else torch.device("cpu")))
    config._register_custom_module({ColumnParallelLinear: ParallelLoraLinear, RowParallelLinear: ParallelLoraLinear})
    peft_model = peft.get_peft_model(
        model, config, adapter_name=adapter_name, autocast_adapter_dtype=autocast_adapter_dtype
    )
    for module in peft_model.modules():
        if isinstance(module, ParallelLoraLinear):
            module.rng = record.rng
    draw_expert_factors(peft_model, adapter_name, config.init_lora_weights, getattr(config, SEED_ATTRIBUTE))
    if record.stage is not None and record.pp_size > 1:
        _save_every_stage(peft_model)
    return peft_model


def whole_peft_model(peft_model: nn.Module) -> Any:
    """The ``PeftModel`` of ``peft_model``'s whole HF model on the meta device (no memory): every layer adapted as
    the run adapted its own, under PEFT's names. PEFT saves the adapters of the layers it finds in the model it is
    called on, and a pipeline stage holds only its own layers."""
    import peft

    hf: Any = hf_model(peft_model)
    with torch.device("meta"), whole_parameters():
        skeleton = type(hf)._from_config(hf.config)
    whole: Any = None
    for name, config in cast(Any, peft_model).peft_config.items():
        with torch.random.fork_rng(devices=[]):  # PEFT draws as it builds: not from this run's generator
            if whole is None:
                whole = peft.get_peft_model(skeleton, copy.deepcopy(config), adapter_name=name)
            else:
                whole.add_adapter(name, copy.deepcopy(config))
        whole.peft_config[name].base_model_name_or_path = config.base_model_name_or_path
    return whole


def _save_every_stage(peft_model: nn.Module) -> None:
    """A pipeline stage's ``save_pretrained(dir, state_dict=accelerator.get_state_dict(model))`` (PEFT's idiom, and
    mtk's ``--save_model``) saves through :func:`whole_peft_model`: the gathered state holds every stage's adapters,
    and the stage's own ``PeftModel`` wrote its stage's only (PEFT loaded the rest at their initial values, unsaid).
    Without a ``state_dict`` a stage has only its own adapters to give: one line."""

    def save_pretrained(save_directory: str, *args: Any, state_dict: Any = None, **kwargs: Any) -> None:
        if state_dict is None:
            raise ConfigError(
                "at pp > 1 a rank's PeftModel holds only its pipeline stage's adapters: pass "
                "state_dict=accelerator.get_state_dict(model), which gathers every stage's"
            )
        if not state_dict:  # another rank's share of the gathered state (empty): the main process writes
            return
        whole_peft_model(peft_model).save_pretrained(save_directory, *args, state_dict=state_dict, **kwargs)

    setattr(peft_model, "save_pretrained", save_pretrained)  # noqa: B010  (this instance only)
