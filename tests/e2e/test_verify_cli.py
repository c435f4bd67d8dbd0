"""``mtk verify`` as a user runs it: the installed console script, real processes."""

import shutil
import subprocess

import pytest

from mtk.models import build_model
from tests.e2e.launch import run_command


def _mtk(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("mtk")
    assert exe, "the mtk console script is installed by the README's install command"
    return run_command([exe, *args], timeout=600)


@pytest.mark.parametrize("model,tp", [("tiny-llama", 2), ("tiny-bert", 2)])
def test_verify_passes_for_builtin_models(model, tp):
    out = _mtk("verify", "--model", model, "--tp", str(tp))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS (tolerance 1e-05 or 2x HF's own fp32 rounding)" in out.stdout
    for quantity in ("logits", "loss", "gradients"):
        assert f"  {quantity}" in out.stdout
    assert out.stdout.count("HF fp32 vs fp64") == 3  # each judged against HF's own rounding on this input


def test_verify_local_directory_and_failing_tolerance(tmp_path):
    build_model("tiny-qwen2", seed=5).save_pretrained(tmp_path)
    out = _mtk("verify", "--model", str(tmp_path), "--tp", "2", "--tolerance", "1e-30")
    assert out.returncode == 1, out.stdout + out.stderr  # nothing is that exact: the check can fail
    assert "FAIL (tolerance 1e-30)" in out.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (("--model", "tiny-llama", "--tp", "3"), "num_attention_heads = 4 is not divisible by tp = 3"),
        (("--model", "no-such-model"), "is neither a built-in config"),
        (("--all", "--seq", "8"), "--seq cannot go with --all"),  # the sweep builds its own batches
        (("--model", "tiny-llama", "--pp", "2"), "--types, --write and --pp go with --all"),
        (("--model", "tiny-llama", "--ep", "2"), "--ep 2: llama has no mixture-of-experts layer"),
        (("--all", "--ep", "2"), "--ep cannot go with --all"),
    ],
)
def test_verify_bad_input_is_one_line(args, message):
    out = _mtk("verify", *args)
    assert out.returncode == 2
    assert message in out.stderr and out.stderr.strip().count("\n") == 0
    assert "Traceback" not in out.stderr


def test_verify_in_fp64_tells_rounding_from_bugs():
    """True fp64 on both sides (mtk's loss promotes instead of casting to fp32; the reference loss is computed
    in fp64, not by HF's fp32 cast): the gap is rounding only, ~1e-16."""
    out = _mtk("verify", "--model", "tiny-gpt2", "--tp", "2", "--dtype", "fp64")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS (tolerance 1e-10)" in out.stdout
    lines = [line for line in out.stdout.splitlines() if "max rel error" in line]
    errors = [float(line.split("max rel error")[1].split()[0]) for line in lines]
    assert len(errors) == 3 and max(errors) < 1e-12


def test_verify_moe_directory_read_through_transformers_conversion(tmp_path):
    """transformers saves Mixtral's experts one tensor per expert (``block_sparse_moe.experts.N.w1``) and merges
    them while loading; mtk reads each rank's slice of the merged tensors from those sources."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from mtk.verify.sweep import tiny_config

    config = tiny_config("mixtral")
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in f.keys()  # the per-expert layout
    out = _mtk("verify", "--model", str(tmp_path), "--tp", "2")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "mixtral (transformers' base_model_tp_plan)" in out.stdout
    # the same directory with its 4 experts spread over EP 2, in fp64: rounding only
    out = _mtk("verify", "--model", str(tmp_path), "--tp", "1", "--ep", "2", "--dtype", "fp64")
    assert out.returncode == 0 and "at tp=1 ep=2" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "PASS (tolerance 1e-10)" in out.stdout


def test_verify_at_expert_parallelism_inside_tensor_parallelism_in_fp64():
    """tiny-qwen3-moe with each expert split over TP 2 and the experts over EP 2 (4 processes, each replica on the
    same batch): logits, the loss with its load-balancing term and every gradient (the experts' averaged over their
    replicas, then gathered over EP and TP) within fp64 rounding of one process."""
    out = _mtk("verify", "--model", "tiny-qwen3-moe", "--tp", "2", "--ep", "2", "--dtype", "fp64")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    errors = [
        float(line.split("max rel error")[1].split()[0]) for line in out.stdout.splitlines() if "rel error" in line
    ]
    assert len(errors) == 3 and max(errors) < 1e-12, out.stdout
