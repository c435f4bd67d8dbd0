"""Built-in model configs by name, and building a model from a name or a local HF directory.

There is no model hub here: tests, ``mtk verify`` and the examples build small models from these
configs with random weights (seeded, so every rank builds the same model), or load a local directory.
The tiny configs use a 259-token vocabulary (256 bytes + 3 specials, matching mtk's byte tokenizer):
an odd size, so vocabulary padding is exercised at every TP degree.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    BertConfig,
    GenerationConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from mtk import jsonio
from mtk.errors import ModelSpecError

__all__ = [
    "BUILTIN",
    "DTYPES",
    "MAX_LAYERS",
    "ModelSpecError",
    "attention_heads",
    "auto_class_for",
    "builtin_config",
    "build_model",
    "causal_lm_refusal",
    "check_config_values",
    "check_seq_len",
    "check_weights",
    "element_size",
    "num_layers",
    "resolve_config",
    "whole_parameters",
    "with_layers",
]

# The dtype names mtk's options take (--dtype of mtk verify, mtk export, mtk bench).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

VOCAB = 259
_LABELS: dict[str, Any] = {"num_labels": 2}  # a PretrainedConfig kwarg BertConfig's signature does not list
SPECIAL_TOKENS: dict[str, Any] = dict(bos_token_id=256, eos_token_id=257, pad_token_id=258)


def _decoder(cls, **overrides) -> Callable[[], PretrainedConfig]:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **SPECIAL_TOKENS,
    )
    return lambda: cls(**{**base, **overrides})


BUILTIN: dict[str, Callable[[], PretrainedConfig]] = {
    "tiny-llama": _decoder(LlamaConfig),
    "tiny-mistral": _decoder(MistralConfig, sliding_window=None),
    "tiny-qwen2": _decoder(Qwen2Config, tie_word_embeddings=True),
    "tiny-qwen3": _decoder(Qwen3Config, head_dim=16),
    "tiny-phi3": _decoder(Phi3Config, num_key_value_heads=4),
    # 8 experts of width 32, two per token, the load-balancing loss in the loss: expert parallelism's model
    "tiny-qwen3-moe": _decoder(
        Qwen3MoeConfig,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    ),
    "tiny-gpt2": lambda: GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, **SPECIAL_TOKENS
    ),
    "tiny-bert": lambda: BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=256,
        **_LABELS,
        **SPECIAL_TOKENS,
    ),
    # The `mtk bench` reference point (docs/bench.md): large enough that compute, not latency, dominates.
    "bench-llama": _decoder(
        LlamaConfig,
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=32768,  # long-context runs (docs/long_context.md); rotary: no parameters
    ),
    # bench-llama with Qwen's 151,936-token vocabulary: the LM head's logits outweigh the decoder's activations
    # (the chunked loss's benchmark, examples/benchmarks/chunked_loss.py).
    "bench-llama-151k": _decoder(
        LlamaConfig,
        vocab_size=151936,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=16384,
    ),
    # bench-llama's attention with Qwen3-MoE's experts (8 of intermediate 768, top 2: about the dense MLP's FLOPs per
    # token, 4x its expert weights): expert parallelism's benchmark (docs/moe.md).
    "bench-qwen3-moe": _decoder(
        Qwen3MoeConfig,
        vocab_size=8192,
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=768,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        max_position_embeddings=32768,
    ),
    # ~216M parameters: large enough to show that a TP load reads only this rank's slices.
    "llama-200m": _decoder(
        LlamaConfig,
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=2048,
    ),
}


def builtin_config(name: str) -> PretrainedConfig:
    if name not in BUILTIN:
        raise ModelSpecError(f"unknown built-in model {name!r}; built-in names: {', '.join(BUILTIN)}")
    config = BUILTIN[name]()
    check_config_values(vars(config), name)
    return config


# The size fields of decoder and encoder configs, under transformers' names and GPT-2's: each a count or a width,
# so 0 divided by zero (heads), -5 built a tensor of negative size, and 4096.0 or "32" failed deep in a model.
_SIZE_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "num_hidden_layers",
    "head_dim",
    "max_position_embeddings",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_embd",
    "n_head",
    "n_layer",
    "n_positions",
    "n_ctx",
    "n_inner",
    "num_layers",
)
_DEPTH_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")
# zero means "none" in some configs (a dense model's experts); head_dim only where the model's own default is 0
_MAY_BE_ZERO = ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_inner")
_FINITE_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta", "initializer_range")
_NESTED = ("text_config", "rope_parameters")  # a multimodal model's decoder; transformers 5 keeps rope_theta here
# far deeper than any released model (the deepest, ~130); a plan of 10^9 layers ran without end, 10^4 for minutes
MAX_LAYERS = 1_000


def check_config_values(values: Mapping[str, Any], source: str | Path, *, where: str | None = None) -> None:
    """Refuse (one line naming the field and ``source``) a model config whose sizes are not whole numbers (zero only
    where a config uses it for "none" or "derived": ``head_dim``, expert counts), whose depth is over
    :data:`MAX_LAYERS`, or whose epsilons, rope base or init range are not finite numbers. A per-layer list of sizes
    (Gemma-3n's widths) is checked element by element; a mapping is left to its model.

    Checked on the values as written, before transformers builds a config from them: its ``__init__`` divides by the
    head count, and a NaN epsilon or a negative vocabulary only fails later, in a plan or a model's first tensor.
    A field the config does not have, or sets to null (GPT-2's ``n_inner``), is not checked. ``where`` starts each
    message (``--model <source>`` unless given): a checkpoint's recorded config is checked here too, and named as one.
    """
    where = f"--model {source}" if where is None else where
    for holder in (values, values.get("text_config")):
        holder = vars(holder) if isinstance(holder, PretrainedConfig) else holder
        if isinstance(holder, Mapping):
            _check_relations(holder, where)
    for name, value in _checked_values(values):
        field = name.rsplit(".", 1)[-1]
        if field in _FINITE_FIELDS:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ModelSpecError(
                    f"{where}: {name} is {_shown(value)}; it must be a finite number: correct the config"
                )
            continue
        if isinstance(value, Mapping):
            continue
        least = 0 if field in _MAY_BE_ZERO or (field == "head_dim" and _zero_head_dim_is_default(values, name)) else 1
        for size in value if isinstance(value, (list, tuple)) else [value]:
            whole = isinstance(size, (int, float)) and not isinstance(size, bool) and math.isfinite(size)
            if not whole or size != int(size) or size < least:
                what = "a whole number >= 0" if least == 0 else "a positive whole number"
                raise ModelSpecError(f"{where}: {name} is {_shown(value)}; it must be {what}: correct the config")
        if field in _DEPTH_FIELDS and isinstance(value, (int, float)) and value > MAX_LAYERS:
            raise ModelSpecError(
                f"{where}: {name} is {value}; mtk builds and plans models of at most {MAX_LAYERS:,} layers: "
                "correct the config"
            )


_PROBABILITIES = ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                  "hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout")  # fmt: skip
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def _check_relations(values: Mapping[str, Any], where: str) -> None:
    """Values valid alone that the modeling code cannot use together, each of which only failed in a forward (or
    trained without a word): a dropout outside [0, 1], more experts per token than experts, or none of several."""
    for name in _PROBABILITIES:
        value = values.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not 0 <= value <= 1:
            raise ModelSpecError(f"{where}: {name} is {_shown(value)}; a dropout is in [0, 1]: correct it")
    experts = next((values[n] for n in _EXPERT_COUNTS if isinstance(values.get(n), int) and values[n] > 0), None)
    chosen = values.get("num_experts_per_tok")
    if experts is not None and isinstance(chosen, int) and not 1 <= chosen <= experts:
        raise ModelSpecError(
            f"{where}: num_experts_per_tok is {chosen} of {experts} experts; each token is routed to 1 to "
            f"{experts}: correct the config"
        )


def _zero_head_dim_is_default(values: Mapping[str, Any], name: str) -> bool:
    """Whether the config's model type itself defaults ``head_dim`` to 0 (GLM-5-Next, whose modeling never reads it);
    elsewhere 0 divides by zero in the rotary embedding."""
    holder = values.get(name.split(".")[0]) if "." in name else values  # the config, or the sub-config, named
    model_type: Any = None
    if isinstance(holder, PretrainedConfig):
        model_type = holder.model_type
    elif isinstance(holder, Mapping):
        model_type = holder.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:  # (a list is not even a mapping's key)
        return False
    try:
        default = CONFIG_MAPPING[model_type]().get_text_config()
    except (ValueError, TypeError, KeyError, StrictDataclassError):  # no defaults to build from: none to honour
        return False
    return vars(default).get("head_dim") == 0  # (getattr raises on configs whose head_dim varies per layer)


def _checked_values(values: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """The (dotted name, value) pairs :func:`check_config_values` checks, sub-configs and rope parameters included."""
    for name in (*_SIZE_FIELDS, *_FINITE_FIELDS):
        if values.get(name) is not None:
            yield prefix + name, values[name]
    for name in _NESTED:
        nested = values.get(name)
        nested = vars(nested) if isinstance(nested, PretrainedConfig) else nested
        if isinstance(nested, Mapping) and not prefix:  # one level: sub-configs do not nest further here
            yield from _checked_values(nested, f"{name}.")


def _shown(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (int, float, str, list, tuple, type(None))) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def resolve_config(spec: str | PretrainedConfig) -> PretrainedConfig:
    """A config from a built-in name, a local HF directory or a config .json file (no remote code)."""
    if isinstance(spec, PretrainedConfig):
        return spec
    if spec in BUILTIN:
        return builtin_config(spec)
    path = Path(spec)
    if path.is_file() and path.suffix == ".json":  # a config.json alone: enough to plan, not to load weights
        return _config_from(path)
    if not (path / "config.json").is_file():
        raise ModelSpecError(
            f"--model {spec!r} is neither a built-in config ({', '.join(BUILTIN)}), a local directory "
            f"with a config.json, nor a config .json file"
        )
    check_weights(path)
    config = _config_from(path)
    if (path / "generation_config.json").is_file() and auto_class_for(config) is AutoModelForCausalLM:
        generation_config_of(path)  # (here for every entry point: generate.py and export's --base load through HF)
    return config


def generation_config_of(directory: Path) -> GenerationConfig:
    """The directory's ``generation_config.json``, or one line: malformed JSON (which ``from_pretrained`` drops
    silently, so a run would save and export transformers' defaults, and generate.py generate with them), JSON that is
    no object, or a value transformers' validation refuses (its traceback)."""
    path = directory / "generation_config.json"
    try:
        record = jsonio.loads(path.read_bytes())
    except (OSError, ValueError) as err:  # (json's errors are ValueErrors, undecodable bytes too)
        raise ModelSpecError(f"{path} is not valid JSON ({err}); fix it or remove it") from None
    if not isinstance(record, dict):
        kind = type(record).__name__
        raise ModelSpecError(f"{path} holds a JSON {kind}, not an object of settings; fix it or remove it")
    try:
        return GenerationConfig.from_pretrained(directory)
    except (OSError, ValueError, TypeError) as err:
        reason = str(err).splitlines()[0].rstrip(".") if str(err) else type(err).__name__
        raise ModelSpecError(f"{path}: {reason}; fix it or remove it") from None


def _config_from(path: Path) -> PretrainedConfig:
    """transformers' config of a local directory or file, never running its code: a config that needs code
    (``auto_map`` with a model type transformers does not ship), that transformers cannot read, or whose values its
    validators refuse (a hidden size the heads do not divide) is one line."""
    _check_config_file(path / "config.json" if path.is_dir() else path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (ValueError, KeyError, OSError, StrictDataclassError) as err:
        custom = "custom code" in str(err) or "trust_remote_code" in str(err)
        cause = err.__cause__ if isinstance(err, StrictDataclassError) and err.__cause__ else err  # the validator's
        reason = (
            "it needs the custom code its auto_map names, and mtk runs no code from a model directory"
            if custom
            else (str(cause).strip().splitlines() or [type(cause).__name__])[0][:160]
        )
        if isinstance(err, StrictDataclassError):  # read, but its values contradict each other
            raise ModelSpecError(f"--model {path}: transformers refuses its config ({reason}); fix it") from None
        raise ModelSpecError(
            f"--model {path}: transformers cannot read its config ({reason}); use a model whose "
            "architecture transformers ships"
        ) from None
    _check_buildable(config, path / "config.json" if path.is_dir() else path)
    return config


def _check_buildable(config: PretrainedConfig, path: Path) -> None:
    """Build the config's model with one layer on the meta device (no memory, no weights): values transformers'
    config accepts but its modeling code cannot use (an unknown ``hidden_act`` or ``rope_type``) are one line here,
    not a ``KeyError`` in whichever command builds the model first. An architecture mtk builds no model of is left
    to the command that needs one."""
    auto_class = auto_class_for(config)
    if type(config) not in auto_class._model_mapping:
        return
    try:
        one_layer = with_layers(config, 1)
        one_layer.pad_token_id = config.pad_token_id  # the embedding's padding index: past the vocabulary, refused
        with torch.device("meta"), whole_parameters():  # (not in ZeRO-3's zero.Init: it refused a valid config)
            auto_class.from_config(one_layer)
    except (
        KeyError,
        ValueError,
        TypeError,
        AssertionError,
        IndexError,
        ZeroDivisionError,
        AttributeError,
        RuntimeError,
    ) as err:
        lines = str(err).strip().splitlines()
        raise ModelSpecError(
            f"--model {path}: transformers cannot build a model from this config ({type(err).__name__}: "
            f"{lines[0] if lines else 'no message'}); correct the config"
        ) from None


def _check_config_file(file: Path) -> None:
    """:func:`check_config_values` on a config file's values as written; a file that is not a JSON object is left to
    transformers' reader, whose refusal :func:`_config_from` words."""
    try:
        values = jsonio.loads(file.read_bytes())
    except (OSError, ValueError):  # unreadable, not UTF-8, not JSON (JSONDecodeError is a ValueError)
        return
    if isinstance(values, dict):
        check_config_values(values, file)


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_weights(directory: Path) -> None:
    """Refuse (one line) a model directory whose weights exist only as pickles: mtk reads weights from safetensors
    only (a pickle can run code when it is loaded)."""
    if not directory.is_dir() or any(directory.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise ModelSpecError(
            f"--model {directory} holds its weights only as pickles ({', '.join(pickles[:3])}); mtk loads safetensors "
            "only (a pickle can run code when it is loaded): re-save the model with save_pretrained(..., "
            "safe_serialization=True)"
        )


def check_seq_len(config: PretrainedConfig, seq_len: int, flag: str = "--seq_len") -> None:
    """Refuse (one line, naming the ``flag`` that set it) a sequence longer than the model's positions (GPT-2
    would fail deep in its forward, rotary models would silently run past what they were trained on)."""
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and seq_len > limit:
        raise ModelSpecError(
            f"{flag} {seq_len} is longer than the model's {limit} positions (max_position_embeddings); "
            f"use at most {limit}"
        )


def num_layers(config: PretrainedConfig) -> int:
    """The model's decoder layers, under whichever name its config keeps them (``num_hidden_layers``, GPT-2's
    ``n_layer``, ``num_layers``)."""
    for name in _DEPTH_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ModelSpecError(f"{type(config).__name__} gives no decoder depth (one of {', '.join(_DEPTH_FIELDS)})")


def attention_heads(config: PretrainedConfig) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of the whole model (GPT-2 names the heads ``n_head``)."""
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def element_size(dtype: str) -> int:
    """Bytes per element of a dtype named as mtk's options name it (:data:`DTYPES`: ``fp32``, ``bf16``, ``fp16``)."""
    return DTYPES[dtype].itemsize


def with_layers(config: PretrainedConfig, layers: int) -> PretrainedConfig:
    """A copy of ``config`` with ``layers`` decoder layers, for a model built on the meta device (per-layer lists
    such as sliding-window layer types keep the new depth; no pad token, which GPT-2 looks for in the batch)."""
    config = copy.deepcopy(config)
    config.pad_token_id = None
    for name in _DEPTH_FIELDS:
        if hasattr(config, name):
            setattr(config, name, layers)
    for name in ("layer_types", "mlp_layer_types"):
        value = getattr(config, name, None)
        if isinstance(value, list) and value:
            with contextlib.suppress(AttributeError):  # a property computed from other fields (Jamba, Bamba) follows
                setattr(config, name, (value * layers)[:layers])
    return config


def auto_class_for(config: PretrainedConfig):
    """Sequence classification for encoders with labels (BERT), causal LM otherwise."""
    if getattr(config, "model_type", None) == "bert":
        return AutoModelForSequenceClassification
    return AutoModelForCausalLM


def is_causal_lm_class(name: str) -> bool:
    """Whether the model class ``name`` predicts the next token: transformers' causal-LM classes (Gemma 3's is a
    ``...ForConditionalGeneration``) and any ``...ForCausalLM`` or ``...LMHeadModel``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() or name.endswith(("ForCausalLM", "LMHeadModel"))


def causal_lm_refusal(config: PretrainedConfig) -> str | None:
    """Why ``config`` is not a model that predicts the next token, or None. transformers builds a causal LM class
    for a BERT (``BertLMHeadModel``) or for a base model's directory all the same, with a randomly initialized
    head and, for an encoder, attention both ways: it generates or measures something meaningless, exit 0."""
    if auto_class_for(config) is not AutoModelForCausalLM:
        return f"{config.model_type} is an encoder (its attention looks both ways)"
    names = getattr(config, "architectures", None) or []
    if names and not any(is_causal_lm_class(name) for name in names):
        return f"its config names {', '.join(names)}, which has no causal language-model head"
    return None


def build_model(spec: str | PretrainedConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A randomly initialized model from a built-in name or config, identical on every rank for ``seed``; whole
    even where transformers would build it under DeepSpeed's ``zero.Init`` (:func:`whole_parameters`), which mtk
    cannot split over TP and which, on a machine without a GPU, reads a batch size filled for one process."""
    config = resolve_config(spec)
    config._attn_implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    torch.manual_seed(seed)
    with whole_parameters():
        return auto_class_for(config).from_config(config, dtype=dtype)


@contextlib.contextmanager
def whole_parameters() -> Iterator[None]:
    """Models built inside are whole on each rank even under accelerate's DeepSpeed ZeRO-3.

    accelerate's DeepSpeed plugin registers its config with transformers whatever ``zero3_init_flag`` says, and
    transformers then builds every model inside ``deepspeed.zero.Init``: each parameter partitioned over all ranks
    at construction, a ``(0,)`` placeholder that mtk cannot split over TP. mtk does not need it: a directory is
    read slice by slice (each rank loads only its TP slice), and ``deepspeed.initialize`` partitions the converted
    model over the data-parallel group, as under the ``deepspeed`` launcher. The registration is put back after.
    """
    from transformers.integrations import deepspeed as hf_deepspeed

    registered = hf_deepspeed._hf_deepspeed_config_weak_ref  # transformers has no public getter for the object
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = registered
