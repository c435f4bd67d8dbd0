"""``mtk verify --all``: every causal-LM architecture of the installed transformers that ships a
``base_model_tp_plan``, built tiny and random, saved as an HF directory, loaded from it by mtk at TP=N (reading
only each rank's slices, as users load models) and compared with transformers' own ``from_pretrained`` of it.

One set of N processes runs the whole sweep (:func:`sweep_worker`), one architecture after another; an
architecture that cannot be built tiny, or that mtk refuses, is a row with the reason, never a crash. Verifying
from disk, not from a model built in memory, is what found GPT-NeoX's head stored as ``embed_out``.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from mtk.models import build_model
from mtk.rules.from_tp_plan import rules_from_tp_plan
from mtk.rules.registry import RULE_SETS, find_rules
from mtk.verify import pipeline_verify_worker, verify_worker

__all__ = ["SweepRow", "causal_lm_types", "sweep_worker", "tiny_config", "tp_plan_types"]

TINY: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,  # hybrids (linear attention) interleave: 4 layers hold a full-attention one
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=64,
    num_experts=4,  # MoE: a few small experts, two per token, the load-balancing loss in the loss
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    output_router_logits=True,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
MAX_PARAMETERS = 20_000_000  # the tiny configs have ~0.2M; more means a field the overrides do not reach


@dataclass
class SweepRow:
    """One architecture's result: ``status`` is ``exact``, ``differs``, ``refused`` or ``not built``."""

    model_type: str
    status: str
    source: str = ""
    logits: float = math.nan
    loss: float = math.nan
    grads: float = math.nan
    reason: str = ""


def tp_plan_types() -> list[str]:
    """Every model type whose config class ships a ``base_model_tp_plan``, sorted."""
    from transformers import CONFIG_MAPPING

    return sorted(t for t, cls in CONFIG_MAPPING.items() if getattr(cls, "base_model_tp_plan", None))


def causal_lm_types() -> list[str]:
    """Model types with a ``base_model_tp_plan`` and a causal-LM class, sorted."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(
        t
        for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if t in CONFIG_MAPPING and getattr(CONFIG_MAPPING[t], "base_model_tp_plan", None)
    )


def tiny_config(model_type: str) -> Any:
    """A tiny random configuration of ``model_type`` (hidden 64, 4 heads, 2 kv heads, 4 layers, vocab 256)."""
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type](**TINY)
    config._attn_implementation = "eager"
    return config


def _source(config: Any, tp_size: int) -> str:
    rule_set = find_rules(config, tp_size)
    if rule_set is None:
        return "generic"
    return "hand" if any(rule_set is known for known in RULE_SETS) else "HF tp_plan"


def _too_big(config: Any) -> str:
    """Why the tiny config is not tiny (a field the common overrides miss), counted on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in model.parameters())
    return f"the tiny config still has {count / 1e6:.0f}M parameters" if count > MAX_PARAMETERS else ""


def sweep_worker(
    rank: int, world_size: int, types: list[str], tolerance: float, pp: int = 1, dtype: str = "fp32"
) -> list[SweepRow]:
    """Run in each of ``world_size`` processes; returns this rank's row per model type. With ``pp > 1`` the
    models run cut into stages by the 1F1B schedule (loss and gradients compared; TP = world / pp)."""

    rows = []
    shared = [tempfile.mkdtemp(prefix="mtk-verify-all-") if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(shared, src=0)
    root = Path(str(shared[0]))
    for model_type in types:
        if rank == 0:
            print(f"mtk verify --all: {model_type}", flush=True)
        try:
            config = tiny_config(model_type)
            too_big = _too_big(config)
        except Exception as err:  # a config class that needs more than the common fields
            rows.append(SweepRow(model_type, "not built", reason=f"tiny config: {str(err).splitlines()[0][:120]}"))
            continue
        source = _source(config, world_size // pp)
        if source == "generic" and rules_from_tp_plan(config)[1] and "does not split" in rules_from_tp_plan(config)[1]:
            rows.append(SweepRow(model_type, "refused", source, reason=rules_from_tp_plan(config)[1]))  # MoE, MLA, ...
            continue
        if too_big:
            rows.append(SweepRow(model_type, "not built", source, reason=too_big))
            continue
        try:
            if pp > 1:
                result = pipeline_verify_worker(rank, world_size, config, pp)
            else:
                result = verify_worker(rank, world_size, _saved(config, root / model_type, rank), dtype, 2, 12, 0)
        except Exception as err:  # the model's own forward fails on the tiny config (or after conversion)
            rows.append(SweepRow(model_type, "not built", source, reason=str(err).splitlines()[0][:160]))
            continue
        if result.error:
            rows.append(SweepRow(model_type, "refused", source, reason=result.error.splitlines()[0][:200]))
            continue
        worst = max(x for x in (result.logits, result.loss, result.grads) if x == x)  # NaN: not measured (pp)
        status = "exact" if worst <= tolerance else "differs"
        rows.append(SweepRow(model_type, status, source, result.logits, result.loss, result.grads, result.worst_param))
    if dist.is_initialized():
        dist.barrier()  # every rank has read every directory
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def _saved(config: Any, directory: Path, rank: int) -> str:
    """The tiny random model as an HF directory: rank 0 writes it, every rank reads it once it is complete."""
    if rank == 0:
        model: Any = build_model(config, seed=0)
        model.save_pretrained(directory)
    if dist.is_initialized():
        dist.barrier()
    return str(directory)
