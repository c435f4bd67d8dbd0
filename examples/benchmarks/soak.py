"""Soak test: a long TP=2 run saving often, with the workers' resident memory sampled as it goes.

    python examples/benchmarks/soak.py                       # 1000 steps of the tiny Llama, a checkpoint every 50

Memory that grows with steps or saves (a leaked tensor, an accumulating list, a file handle per save)
shows as a rising RSS; a healthy run is flat after warm-up. Prints the workers' RSS at the first
checkpoint and at the end, and their ratio (the figures in docs/reliability.md come from here).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root: examples/benchmarks/soak.py


def _workers() -> list[int]:
    """PIDs of running examples/finetune.py processes (the launcher's workers)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(part.endswith(b"examples/finetune.py") for part in cmdline) and b"accelerate" not in cmdline[1]:
                pids.append(int(proc.name))
    return pids


def _rss_mib(pid: int) -> float:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--save_every", type=int, default=50)
    args = parser.parse_args()
    samples: list[tuple[int, float]] = []  # (step, total worker RSS)
    step = 0
    with tempfile.TemporaryDirectory() as out:
        run = ["--max_steps", str(args.steps), "--save_every", str(args.save_every), "--output_dir", out]
        command = [
            "accelerate",
            "launch",
            "--config_file",
            "accelerate_configs/tp2.yaml",
            "examples/finetune.py",
            *run,
        ]
        launcher = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def sample() -> None:
            while launcher.poll() is None:
                pids = _workers()
                if pids and step:
                    samples.append((step, sum(_rss_mib(pid) for pid in pids)))
                time.sleep(1.0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        start = time.perf_counter()
        for line in launcher.stdout:
            if match := re.search(r"step (\d+) loss", line):
                step = int(match[1])
        launcher.wait()
        sampler.join()
        checkpoints = len(list(Path(out).glob("step_*")))
    if launcher.returncode != 0 or not samples:
        raise SystemExit(f"the run failed (exit {launcher.returncode})")
    first = next(rss for s, rss in samples if s >= args.save_every)
    peak_late = max(rss for s, rss in samples if s >= args.steps // 2)
    last = samples[-1][1]
    print(f"{step} steps, {checkpoints} checkpoints in {time.perf_counter() - start:.0f} s; workers' total RSS (MiB):")
    print(f"  after the first checkpoint {first:8.0f}")
    print(f"  peak in the second half    {peak_late:8.0f}")
    print(f"  at the end                 {last:8.0f}   (end / first checkpoint: {last / first:.3f})")


if __name__ == "__main__":
    main()
