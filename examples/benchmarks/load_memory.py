"""Peak memory of loading a model: full HF load vs each rank of an mtk TP load (slices only).

    python examples/benchmarks/load_memory.py                       # llama-200m (~216M params, 0.87 GB fp32), tp 2
    python examples/benchmarks/load_memory.py --model tiny-llama    # seconds, for a smoke test

Each measurement runs in fresh processes and reports peak RSS (``ru_maxrss``), next to the peak of a
process that only imports torch, transformers and mtk, so the difference is what loading cost. Every
parameter is read once after loading (a sum): safetensors tensors may be backed by the memory-mapped
file, whose pages only become resident when touched, and a model that is trained touches them all.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from mtk.spawn import run_distributed


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _current_mib() -> float:
    """Resident memory now: after loading, with the checkpoint files closed (page cache excluded)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _child(code: str) -> float:
    """Run ``code`` in a fresh interpreter and return its peak RSS in MiB."""
    script = f"import resource, torch, transformers, mtk.checkpoint\n{code}\n" + (
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _tp_load(rank: int, world_size: int, directory: str) -> dict:
    from mtk.checkpoint import load_pretrained_tp
    from mtk.parallel import ParallelState

    model = load_pretrained_tp(directory, ParallelState.build(tp_size=world_size))
    for param in model.parameters():
        param.sum()  # make every page resident (see the module docstring)
    local = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    return {"peak_mib": _peak_mib(), "now_mib": _current_mib(), "local_params_mib": local}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-200m", help="built-in config name (default llama-200m)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dir", help="where the HF directory is (or is written); default: a temporary dir")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(args.dir or Path(tmp) / args.model)
        if not (directory / "config.json").exists():
            print(f"writing {args.model} to {directory} ...", flush=True)
            _child(
                f"from mtk.models import build_model; build_model({args.model!r}).save_pretrained({str(directory)!r})"
            )
        size = sum(f.stat().st_size for f in directory.glob("*.safetensors")) / 2**20
        baseline = _child("pass")
        full = _child(
            "from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(directory)!r}); "
            "[p.sum() for p in m.parameters()]"
        )
        ranks = run_distributed(
            _tp_load, world_size=args.tp, args=(str(directory),), timeout=1800, fresh_interpreters=True
        )
        print(f"\n{args.model}: {size:.0f} MiB of safetensors weights; peak RSS per process (MiB)")
        print(f"  imports only (baseline)      {baseline:8.0f}")
        print(f"  full HF load                 {full:8.0f}   (+{full - baseline:.0f} over baseline)")
        for rank, r in enumerate(ranks):
            print(
                f"  mtk tp={args.tp} load, rank {rank}      {r['peak_mib']:8.0f}   (+{r['peak_mib'] - baseline:.0f}; "
                f"{r['now_mib']:.0f} after the files are closed; holds {r['local_params_mib']:.0f} MiB of parameters)"
            )
        worst = max(r["peak_mib"] for r in ranks) - baseline
        print(f"  largest TP rank / full load, above baseline: {worst / max(full - baseline, 1):.2f}")


if __name__ == "__main__":
    main()
