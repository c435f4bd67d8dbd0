"""Test helpers: spawn gloo processes from pytest and compare with the exactness bar.

def _check(rank, world_size, scale):       # module level, so the spawned workers can import it
    ...
    return some_picklable_value

def test_thing():
    results = run_distributed(_check, world_size=2, args=(0.5,))   # one value per rank
"""

from __future__ import annotations

from mtk.spawn import DistributedTestError, free_port, run_distributed

__all__ = ["RTOL", "DistributedTestError", "assert_close_rel", "free_port", "max_rel_error", "run_distributed"]

RTOL = 1e-5  # the exactness bar: fp32 parallel results vs the single-process reference


def max_rel_error(actual, expected, scale_floor: float = 0.0) -> float:
    """``max|actual - expected| / max(max|expected|, scale_floor)``: one number per tensor.

    ``scale_floor`` is for tensors whose exact value is (near) zero, e.g. the gradient of an attention
    key bias, which softmax makes exactly zero: their entries are rounding noise, so they are measured
    against the scale of the quantity they belong to (the model's largest gradient) instead.
    """
    import torch

    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    if actual.shape != expected.shape:
        raise AssertionError(f"shape mismatch: {tuple(actual.shape)} vs expected {tuple(expected.shape)}")
    scale = max(expected.abs().max().item() if expected.numel() else 0.0, scale_floor)
    diff = (actual - expected).abs().max().item() if expected.numel() else 0.0
    return diff / scale if scale > 0 else diff


def assert_close_rel(actual, expected, what: str = "tensor", tol: float = RTOL, scale_floor: float = 0.0) -> float:
    """Fail unless ``max_rel_error(actual, expected, scale_floor) <= tol``; returns the error."""
    err = max_rel_error(actual, expected, scale_floor)
    if not err <= tol:
        raise AssertionError(f"{what}: max relative error {err:.3e} > {tol:.0e}")
    return err


# ChatML, as SmolLM2 and Qwen use it: "<|im_start|>role\ncontent<|im_end|>\n" per turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_chat_tokenizer(texts: list[str], vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on ``texts`` in a second or so, with a ChatML chat template: a
    real ``PreTrainedTokenizerFast`` for tests, with no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|endoftext|>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
    )
