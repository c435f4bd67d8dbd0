"""Run the used-by commands exactly as users type them (``accelerate launch ...``), on a free port."""

import re
import subprocess
from pathlib import Path

from mtk.spawn import free_port
from tests.e2e.forked import accelerate_in_forks, command_in_forks, forks_wanted

ROOT = Path(__file__).resolve().parents[2]
STEP_LINE = re.compile(r"step (\d+) loss (\S+)")


def accelerate_launch(
    script: str,
    config: str,
    *args: str,
    launcher_args: tuple = (),
    check: bool = True,
    timeout: int = 600,
    env: dict | None = None,
    real: bool = False,
) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file <config> [launcher_args] <script> [args]`` from the repo root.

    ``config`` is a name in accelerate_configs/ or a path to a YAML file; ``script`` a file in
    examples/ or a path relative to the repo root. The ranks fork from the fork server (:mod:`tests.e2e.forked`)
    unless ``real``: then ``accelerate launch`` runs as a command, torchrun and fresh interpreters included.
    """
    config_path = config if config.endswith(".yaml") else f"accelerate_configs/{config}.yaml"
    command = [
        "accelerate",
        "launch",
        "--config_file",
        config_path,
        "--main_process_port",
        str(free_port()),
        *launcher_args,
        script if "/" in script else f"examples/{script}",
        *args,
    ]
    if forks_wanted() and not real:
        out = accelerate_in_forks(command[2:], cwd=ROOT, environ=env, timeout=timeout)
    else:
        out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert out.returncode == 0, _workers_story(out.stderr)
    return out


def run_command(
    command: list[str], *, cwd: Path | str | None = None, env: dict | None = None, timeout: float = 600, check=False
) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True)``, from the fork server for the suite's own kinds
    of command (``python``, ``torchrun``, ``deepspeed`` on one node, ``mtk``: :func:`forked.command_in_forks`)."""
    out = None
    if forks_wanted():
        out = command_in_forks(command, cwd=Path(cwd or Path.cwd()), environ=env, timeout=timeout)
    if out is None:
        out = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode:
        raise subprocess.CalledProcessError(out.returncode, command, out.stdout, out.stderr)
    return out


def _workers_story(stderr: str) -> str:
    """What the workers said before the launcher's own traceback (which is all the tail would show)."""
    launcher = stderr.rfind("torch.distributed.elastic.multiprocessing.errors.ChildFailedError")
    head = stderr[: stderr.rfind("Traceback", 0, launcher)] if launcher > 0 else stderr
    return head[-6000:] + "\n[...launcher...]\n" + stderr[-1500:]


def step_losses(out: subprocess.CompletedProcess) -> dict[int, float]:
    """``step N loss X`` lines (printed at full precision by the examples)."""
    return {int(step): float(loss) for step, loss in STEP_LINE.findall(out.stdout + out.stderr)}


def finetune(config: str, out_dir, *args: str) -> dict[int, float]:
    """``examples/finetune.py`` at ``config``, writing to ``out_dir``; its per-step losses."""
    return step_losses(accelerate_launch("finetune.py", config, "--output_dir", str(out_dir), *args))


def logged(out_dir, tag: str = "train/grad_norm") -> dict[int, float]:
    """One tensorboard scalar of a run (``<out_dir>/runs``, written by rank 0) by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(Path(out_dir) / "runs"))
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


def assert_same_losses(actual: dict[int, float], expected: dict[int, float], steps, what: str = "") -> None:
    """Exactly ``steps`` were logged, each within the exactness bar of ``expected``."""
    from mtk.testing import assert_close_rel

    assert sorted(actual) == list(steps), actual
    prefix = f"{what}: " if what else ""
    for step in steps:
        assert_close_rel(actual[step], expected[step], f"{prefix}loss at step {step}")


def assert_checkpoint_whole(step) -> None:
    """``mtk verify-checkpoint step`` passes: every file matches its checksum and every tensor and optimizer state
    rebuilds whole from its shards and pieces (EP's and FSDP2's included)."""
    from mtk.cli.main import main as mtk_main

    assert mtk_main(["verify-checkpoint", str(step)]) == 0, step


def one_line_error(out: subprocess.CompletedProcess, message: str, prog: str = "finetune.py") -> None:
    """The run failed with exactly one ``<prog>: error: ...`` line, containing ``message``."""
    assert out.returncode != 0
    ours = [line for line in out.stderr.splitlines() if line.startswith(f"{prog}: error:")]
    assert len(ours) == 1 and message in ours[0], out.stderr[-2000:]


def deepspeed_run(processes: int, config: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus <processes> examples/run.py --deepspeed --deepspeed_config <config> [args]``."""
    command = [
        "deepspeed",
        "--num_gpus",
        str(processes),
        "--master_port",
        str(free_port()),
        "examples/run.py",
        "--deepspeed",
        "--deepspeed_config",
        config if config.endswith(".json") else f"ds_configs/{config}.json",
        *args,
    ]
    out = run_command(command, cwd=ROOT, timeout=900)
    if check:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out
