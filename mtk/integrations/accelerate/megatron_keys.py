"""Every ``megatron_lm_config`` key ``accelerate launch`` exports, and what mtk does with it.

accelerate turns the YAML's ``megatron_lm_config`` block into ``MEGATRON_LM_*`` variables
(accelerate/utils/launch.py); some are exported always, with accelerate's defaults. Each one here is
acted on (read into :class:`~mtk.config.ParallelConfig` / :class:`~mtk.config.RunSettings`, or by the
Accelerator), accepted only at its "off" value, or refused in one line naming the key. A variable
this table does not know (a newer accelerate) is refused too: nothing is accepted and ignored.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, cast

from torch import nn

from mtk.config import RunSettings
from mtk.errors import ConfigError
from mtk.integrations.accelerate.launcher import check_launcher_keys, launcher_config_file
from mtk.parallel.recompute import enable_recompute
from mtk.parallel.record import parallelized

__all__ = ["ATTENTION_BACKENDS", "MEGATRON_KEYS", "act_on_model", "check_engine", "check_megatron_environment"]

PREFIX = "MEGATRON_LM_"

# Megatron's attention backends -> HF's attn_implementation ("auto": the model's own choice).
ATTENTION_BACKENDS = {
    "auto": None,
    "unfused": "eager",
    "local": "eager",
    "fused": "sdpa",
    "flash": "flash_attention_2",
}

_FALSE = {"false", "0", "no", "off", ""}

# Keys read into mtk's settings (mtk.config) or acted on by the Accelerator.
ACTED_ON = {
    "TP_DEGREE": "ParallelConfig.tp_size",
    "PP_DEGREE": "ParallelConfig.pp_size",
    "CONTEXT_PARALLEL_SIZE": "ParallelConfig.cp_size",
    "EXPERT_MODEL_PARALLEL_SIZE": "ParallelConfig.ep_size",
    "EXPERT_TENSOR_PARALLEL_SIZE": "ParallelConfig.etp_size",
    "NUM_MICRO_BATCHES": "RunSettings.num_micro_batches",
    "GRADIENT_CLIPPING": "RunSettings.gradient_clipping",
    "SEQUENCE_PARALLELISM": "RunSettings.sequence_parallel",
    "EOD_MASK_LOSS": "RunSettings.eod_mask_loss",
    "DECODER_LAST_PIPELINE_NUM_LAYERS": "RunSettings.last_stage_layers",
    "RECOMPUTE_ACTIVATIONS": "RunSettings.recompute_activations",
    "RECOMPUTE_GRANULARITY": "RunSettings.recompute_granularity",
    "RECOMPUTE_METHOD": "RunSettings.recompute_method",
    "RECOMPUTE_NUM_LAYERS": "RunSettings.recompute_num_layers",
    "ATTENTION_BACKEND": "the HF model's attn_implementation",
    "USE_DISTRIBUTED_OPTIMIZER": "RunSettings.use_distributed_optimizer",
}

# Keys accepted at their off value (what accelerate exports when the YAML does not set them); on: why not.
OFF_ONLY = {
    "USE_CUSTOM_FSDP": "mtk shards parameters over data parallelism with FSDP2 through accelerate's "
    "parallelism_config (accelerate_configs/tp2_fsdp2.yaml) or with DeepSpeed ZeRO (ds_configs/), not Megatron's "
    "custom FSDP",
    "NO_SAVE_OPTIM": "mtk's checkpoints always hold the optimizer so a resume is exact; for weights only, "
    "`mtk export` a checkpoint",
    "NO_LOAD_OPTIM": "a resume restores the optimizer to stay exact; to start afresh from trained weights, "
    "`mtk export` the checkpoint and pass the folder as --model",
    "OPTIMIZER_CPU_OFFLOAD": "offload the optimizer with DeepSpeed (ds_configs/zero2_offload.json)",
    "USE_PRECISION_AWARE_OPTIMIZER": "mtk's optimizer state follows accelerate's mixed precision (fp32 master state)",
    "OVERLAP_CPU_OPTIMIZER_D2H_H2D": "it applies to Megatron's CPU-offloaded optimizer, which mtk does not use",
}
# Keys whose effect belongs to the HF model's config.json, not the launcher.
MODEL_DECIDES = {
    "ATTENTION_DROPOUT": "set the attention dropout in the model's config.json (attention_dropout, attn_pdrop, "
    "attention_probs_dropout_prob: the name depends on the family)",
    "HIDDEN_DROPOUT": "set the hidden dropout in the model's config.json (resid_pdrop, hidden_dropout_prob: the name "
    "depends on the family)",
    "USE_ROTARY_POSITION_EMBEDDINGS": "the HF model's architecture decides its position embeddings",
}
# Keys reported in one line: mtk's behaviour is fixed and the line says what it is.
REPORTED = {
    "ATTENTION_SOFTMAX_IN_FP32": "HF's attention code decides the softmax precision (its eager attention computes "
    "softmax in fp32)",
    "CALCULATE_PER_TOKEN_LOSS": "the loss is what the model call computes: HF's mean over the call's labelled tokens, "
    "or their sum / num_items_in_batch, which mtk's examples pass so a step's loss is the mean over all its tokens",
}

MEGATRON_KEYS = (*ACTED_ON, *OFF_ONLY, *MODEL_DECIDES, *REPORTED)


def _key(variable: str) -> str:
    return "megatron_lm_" + variable.removeprefix(PREFIX).lower()


def check_megatron_environment(env: Mapping[str, str], report: Callable[[str], None]) -> None:
    """Refuse (``ConfigError``, one line) any ``MEGATRON_LM_*`` variable mtk cannot honour; ``report``
    the ones whose behaviour mtk fixes, and the layout when the block gave neither TP nor PP."""
    for variable, raw in sorted(env.items()):
        if not variable.startswith(PREFIX):
            continue
        name, value = variable.removeprefix(PREFIX), raw.strip().lower()
        if name in ACTED_ON:
            continue
        if name in OFF_ONLY:
            if value not in _FALSE:
                raise ConfigError(f"{_key(variable)}: {raw} is not supported: {OFF_ONLY[name]}; remove the key")
        elif name in MODEL_DECIDES:
            raise ConfigError(f"{_key(variable)}: {raw} is not applied by mtk: {MODEL_DECIDES[name]}; remove the key")
        elif name in REPORTED:
            report(f"mtk: {_key(variable)}={raw}: {REPORTED[name]}")
        else:
            raise ConfigError(
                f"{variable}={raw}: {_key(variable)} is a megatron_lm key mtk does not know (a newer accelerate?); "
                f"remove it (known: {', '.join(_key(k) for k in MEGATRON_KEYS)})"
            )
    backend = env.get(PREFIX + "ATTENTION_BACKEND", "").strip().lower()
    if backend and backend not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"megatron_lm_attention_backend: {backend!r} is unknown; use one of {list(ATTENTION_BACKENDS)}"
        )
    # the launcher's YAML whatever its distributed_type: a megatron_lm_config block beside DEEPSPEED or FSDP is
    # dropped by accelerate as a misspelt key is
    check_launcher_keys(launcher_config_file())
    if env.get("ACCELERATE_USE_MEGATRON_LM", "").lower() == "true":
        sizes = [env.get(PREFIX + key, "1").strip() for key in ("TP_DEGREE", "PP_DEGREE", "CONTEXT_PARALLEL_SIZE")]
        spread = env.get(PREFIX + "EXPERT_MODEL_PARALLEL_SIZE", "1").strip()
        if sizes == ["1", "1", "1"] and spread in ("", "1"):  # (CP or EP alone split the work too)
            report(
                "mtk: megatron_lm_config gives tp=1 and pp=1, so every process is a data-parallel replica (accelerate "
                "exports 1 for a missing megatron_lm_tp_degree, and drops a misspelt key without a word)"
            )


def check_engine(settings: RunSettings, *, deepspeed: bool) -> None:
    """Settings DeepSpeed's engine cannot honour, refused in one line."""
    if deepspeed and settings.use_distributed_optimizer:
        raise ConfigError(
            "megatron_lm_use_distributed_optimizer with DeepSpeed: ZeRO already shards the optimizer over DP; "
            "drop one of them"
        )
    if deepspeed and settings.sequence_parallel:
        raise ConfigError(
            "sequence parallelism does not run under DeepSpeed (ZeRO reduces gradients before the sequence-"
            "parallel ones are summed over TP); use a megatron_lm_config YAML (accelerate_configs/tp2_sp.yaml)"
        )


def act_on_model(model: nn.Module, settings: RunSettings, report: Callable[[str], None]) -> None:
    """The keys that act on the HF model itself: the attention backend, activation recomputation."""
    backend = os.environ.get(PREFIX + "ATTENTION_BACKEND", "").strip().lower()
    implementation = ATTENTION_BACKENDS.get(backend)
    if implementation:
        try:
            cast(Any, model).set_attn_implementation(implementation)
        except (ImportError, ValueError) as err:  # (flash_attn not installed, a model without that kernel)
            said = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
            raise ConfigError(
                f"megatron_lm_attention_backend: {backend} ({implementation}) cannot run here: {said.rstrip('.')}; "
                "use fused (sdpa) or auto"
            ) from None
    record = parallelized(model)
    for line in enable_recompute(model, settings, record.rng if record else None):
        report(line)
