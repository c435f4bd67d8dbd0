"""The bench's table and JSON: per contender step times, tokens/s, memory, collectives vs predicted."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from collections import Counter
from pathlib import Path
from typing import Any

from mtk.bench.contenders import BenchSpec
from mtk.bench.runner import ContenderSummary
from mtk.errors import ConfigError
from mtk.models import element_size, resolve_config
from mtk.pipeline.schedules import bubble_fraction, bubble_overhead
from mtk.planner.collectives import Predicted

__all__ = ["check_json_target", "collective_lines", "format_report", "report_dict", "write_json"]


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def collective_lines(measured: dict[str, dict[str, int]], predicted: Predicted) -> list[str]:
    """``all_reduce  20 calls  8.0 MiB   predicted 20 calls  8.0 MiB  ok`` per kind (either side)."""
    lines = []
    for kind in sorted(set(measured) | set(predicted.counts)):
        got = measured.get(kind, {"count": 0, "bytes": 0})
        want_count, want_bytes = predicted.counts[kind], predicted.nbytes[kind]
        verdict = "ok" if (got["count"], got["bytes"]) == (want_count, want_bytes) else "DIFFERS"
        lines.append(
            f"  {kind:<14} {got['count']:>4} calls {_mib(got['bytes']):>10}   "
            f"predicted {want_count:>4} calls {_mib(want_bytes):>10}  {verdict}"
        )
    return lines


def report_dict(spec: BenchSpec, summaries: list[ContenderSummary], predicted: Predicted, busy: list[float]) -> dict:
    tokens = spec.batch * spec.seq
    ours = next((s for s in summaries if s.name == "mtk"), None)
    rows = []
    for s in summaries:
        row = {
            "name": s.name,
            "processes": s.processes,
            "threads_per_process": s.threads,
            "error": s.error,
            "median_s": s.median_s,
            "min_s": s.min_s,
            "tokens_per_s": tokens / s.median_s if s.median_s else None,
            "peak_memory_per_rank": s.peak_memory,
            "memory_above_start_per_rank": s.memory_above_start,
            "memory_by_kind_per_rank": s.memory_by_kind,
            "pipeline_busy_s_per_rank": s.pipeline_busy_s,
            "pipeline_schedule_s_per_rank": s.pipeline_schedule_s,
            "loss": s.loss,
            "collectives": s.collectives,
            "steps_timed": len(s.step_s),
        }
        if ours is not None and ours.median_s and s.median_s and s is not ours:
            row["mtk_time_ratio"] = ours.median_s / s.median_s
        rows.append(row)
    report: dict[str, Any] = {
        "spec": {k: v for k, v in vars(spec).items() if k != "checkpoint_dir"},
        "predicted_collectives": predicted.as_dict(),
        "machine_busy_before_launch": {"min": min(busy, default=0.0), "max": max(busy, default=0.0)},
        "cpu_count": os.cpu_count(),
        "contenders": rows,
    }
    one_stage = next((s for s in summaries if s.name == "mtk-one-stage" and s.median_s), None)
    if spec.pp_size > 1 and ours is not None and ours.median_s and one_stage is not None:
        report["pipeline"] = pipeline_ideal(spec, ours, one_stage)
    times = {s.name: s.median_s for s in summaries if s.median_s}
    if "mtk-accelerator" in times and "accelerate" in times:  # mtk.Accelerator at TP = 1 vs plain accelerate
        report["accelerator_overhead"] = times["mtk-accelerator"] / times["accelerate"]
    one_thread = next((s for s in summaries if s.name == "hf-1thread" and s.median_s), None)
    if (
        spec.tp_size > 1
        and spec.pp_size == spec.dp_size == 1
        and ours is not None
        and ours.median_s
        and one_thread is not None
    ):
        report["tensor_parallel"] = tensor_parallel_floor(spec, ours, one_thread, predicted)
    one_replica = next((s for s in summaries if s.name == "mtk-one-replica" and s.median_s), None)
    if spec.dp_size > 1 and ours is not None and ours.median_s and one_replica is not None:
        # FSDP2's gathers and reduce-scatters run inside the step, unit by unit: no all-reduce to time apart
        report["data_parallel"] = {**data_parallel_ideal(ours, one_replica), "fsdp": spec.fsdp}
    return report


def tensor_parallel_floor(
    spec: BenchSpec, ours: ContenderSummary, one_thread: ContenderSummary, predicted: Predicted
) -> dict:
    """TP against its floor: the one-thread HF step split over ``tp`` ranks, plus the step's all-reduces
    (their predicted bytes, as ``[b, s, h]`` activations) at the measured time of one, nothing overlapped."""
    assert ours.median_s is not None and one_thread.median_s is not None
    per_all_reduce = max((x for x in ours.activation_all_reduce_s if x is not None), default=0.0)
    hidden = resolve_config(spec.model).hidden_size
    activation = spec.batch * spec.seq * hidden * element_size(spec.dtype)
    all_reduces = predicted.nbytes["all_reduce"] / activation
    floor = one_thread.median_s / spec.tp_size + all_reduces * per_all_reduce
    return {
        "one_thread_s": one_thread.median_s,
        "activation_all_reduces": all_reduces,
        "all_reduce_s": per_all_reduce,
        "floor_s": floor,
        "measured_vs_floor": ours.median_s / floor,
        "best_vs_floor": (ours.min_s or ours.median_s) / floor,
    }


def data_parallel_ideal(ours: ContenderSummary, one_replica: ContenderSummary) -> dict:
    """Data parallelism against its ideal: one replica's step plus one DP all-reduce of the gradients (the
    slowest rank's, measured with every rank starting together), nothing overlapped."""
    assert ours.median_s is not None and one_replica.median_s is not None
    reduction = max((x for x in ours.reduction_s if x is not None), default=0.0)
    ideal = one_replica.median_s + reduction
    return {
        "one_replica_s": one_replica.median_s,
        "reduction_s": reduction,
        "ideal_s": ideal,
        "measured_vs_ideal": ours.median_s / ideal,
    }


def pipeline_ideal(spec: BenchSpec, ours: ContenderSummary, one_stage: ContenderSummary) -> dict:
    """The pipeline against its ideal: the one-stage step split over ``p`` stages, plus its bubble overhead
    ``(p - 1) / (v m)`` (Megatron's formula; ``v = 1`` but for the interleaved schedule).

    Each stage's idle share is the part of the pipeline's schedule time (the longest rank's, every rank
    starting together after the step's barrier) it did not compute: blocked on a neighbour, or done early.
    A faster stage idles more; the bubble fraction is the slowest stage's idle share (what the schedule itself
    costs), held against the formula's ``(p - 1) / (v m + p - 1)``."""
    p, m, v = spec.pp_size, spec.micro_batches, spec.virtual_stages
    assert ours.median_s is not None and one_stage.median_s is not None
    ideal = one_stage.median_s / p * (1 + bubble_overhead(p, m, v))
    per_stage = spec.tp_size * spec.dp_size
    busy, schedule = list(ours.pipeline_busy_s), [s for s in ours.pipeline_schedule_s if s is not None]
    idle = [1 - b / max(schedule) if b is not None and schedule else None for b in busy]
    per_stage_idle = [idle[stage * per_stage] for stage in range(p)] if len(idle) == p * per_stage else []
    known = [x for x in per_stage_idle if x is not None]
    return {
        "one_stage_s": one_stage.median_s,
        "ideal_s": ideal,
        "measured_vs_ideal": ours.median_s / ideal,
        "schedule": spec.pipeline_schedule,
        "virtual_stages": v,
        "bubble_fraction_formula": bubble_fraction(p, m, v),
        "idle_per_stage": per_stage_idle,
        "bubble_fraction": min(known) if known else None,
    }


def format_report(report: dict) -> str:
    spec = report["spec"]
    out = [
        f"mtk bench: {spec['model']} tp={spec['tp_size']} pp={spec['pp_size']} "
        + (f"cp={spec['cp_size']} ({spec['cp_comm']}) " if spec.get("cp_size", 1) > 1 else "")
        + f"batch {spec['batch']} x seq {spec['seq']}, {spec['dtype']}, {spec['steps']} timed steps per round",
        f"{'contender':<22} {'procs x thr':>11} {'median s':>9} {'min s':>7} {'tokens/s':>9} "
        f"{'peak mem/rank':>14} {'mtk time ratio':>15}",
    ]
    for row in report["contenders"]:
        layout = f"{row['processes']} x {row['threads_per_process']}"
        if row["error"]:
            out.append(f"{row['name']:<22} {layout:>11}  failed: {row['error']}")
            continue
        memory = max(row["peak_memory_per_rank"]) / 2**20
        ratio = f"{row['mtk_time_ratio']:.2f}x" if "mtk_time_ratio" in row else "-"
        out.append(
            f"{row['name']:<22} {layout:>11} {row['median_s']:>9.3f} {row['min_s']:>7.3f} "
            f"{row['tokens_per_s']:>9.0f} {memory:>10.0f} MiB {ratio:>15}"
        )
    ours = next((r for r in report["contenders"] if r["name"] == "mtk" and not r["error"]), None)
    if ours is not None:
        out.append("collectives per step on rank 0 (mtk), measured vs predicted from the model's shapes:")
        predicted = Predicted(
            counts=_counter(report["predicted_collectives"], "count"),
            nbytes=_counter(report["predicted_collectives"], "bytes"),
        )
        out += collective_lines(ours["collectives"], predicted)
    pipeline = report.get("pipeline")
    if pipeline:
        stages = " ".join(f"{x:.2f}" for x in pipeline["idle_per_stage"] if x is not None)
        out.append(
            f"pipeline: {ours['median_s'] if ours else 0:.3f} s/step against an ideal of {pipeline['ideal_s']:.3f} "
            f"(one stage {pipeline['one_stage_s']:.3f} s / p x (1 + (p-1)/(v m))): "
            f"{pipeline['measured_vs_ideal']:.2f}x; "
            f"{pipeline['schedule']} (v={pipeline['virtual_stages']}): idle share per stage {stages}, bubble fraction "
            f"(the slowest stage's) {pipeline['bubble_fraction'] or 0:.2f} against (p-1)/(v m+p-1) = "
            f"{pipeline['bubble_fraction_formula']:.2f}"
        )
    floor = report.get("tensor_parallel")
    if floor:
        out.append(
            f"tensor parallel: {ours['median_s'] if ours else 0:.3f} s/step against a floor of {floor['floor_s']:.3f} "
            f"(plain HF 1 thread {floor['one_thread_s']:.3f} s / tp + {floor['activation_all_reduces']:.1f} "
            f"all-reduces x {floor['all_reduce_s'] * 1e3:.2f} ms): {floor['measured_vs_floor']:.2f}x (best step "
            f"{floor['best_vs_floor']:.2f}x)"
        )
    if "accelerator_overhead" in report:
        ratio = report["accelerator_overhead"]
        out.append(f"mtk.Accelerator at TP=1 against plain accelerate on the same loop: {ratio:.2f}x step time")
    data_parallel = report.get("data_parallel")
    if data_parallel and data_parallel.get("fsdp"):
        out.append(
            f"data parallel (FSDP2): {ours['median_s'] if ours else 0:.3f} s/step against one replica's "
            f"{data_parallel['one_replica_s']:.3f} s: {data_parallel['measured_vs_ideal']:.2f}x (its gathers and "
            f"reduce-scatters, counted above, run inside the step)"
        )
    elif data_parallel:
        out.append(
            f"data parallel: {ours['median_s'] if ours else 0:.3f} s/step against an ideal of "
            f"{data_parallel['ideal_s']:.3f} (one replica {data_parallel['one_replica_s']:.3f} s + one gradient "
            f"all-reduce {data_parallel['reduction_s']:.3f} s): {data_parallel['measured_vs_ideal']:.2f}x"
        )
    busy = report["machine_busy_before_launch"]
    out.append(
        f"machine: {report['cpu_count']} cores, busy {busy['min']:.0%}-{busy['max']:.0%} of the time just before "
        f"each launch (other work; above a few % the timings shared the machine)"
    )
    out.append("mtk time ratio = mtk's median step time / the contender's (below 1: mtk is faster)")
    return "\n".join(out)


def _counter(table: dict, key: str) -> Counter:
    return Counter({kind: values[key] for kind, values in table.items()})


# names of a process's streams (/dev/stdout, /proc/self/fd/1), written as they are even where they lead to a
# regular file (a shell's log, appended to): that file is not the report's to replace
_STREAM_NAMES = ("/dev/stdout", "/dev/stderr")
_STREAM_FOLDERS = ("/dev/fd/", "/proc/")


def _is_stream(path: Path) -> bool:
    """Whether ``path`` is written in place (a device, a FIFO, a process's stream), not staged and renamed."""
    absolute = os.path.abspath(path)
    if absolute in _STREAM_NAMES or absolute.startswith(_STREAM_FOLDERS):
        return True
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)  # a device (/dev/null, /dev/full), a FIFO, a socket
    except FileNotFoundError:
        return False  # a new file


def check_json_target(path: str | Path) -> None:
    """Refuse now (one line), not after a benchmark of minutes, a ``--json`` file that cannot be written: a file is
    created beside it (on the same file system) and a byte written, synced and removed, so a full or read-only
    file system, a missing folder or a folder this user may not write is said before anything runs; the user's own
    file is never touched. A device is sent an empty write (``/dev/full`` refuses even that; a terminal prints
    nothing), a FIFO nothing at all (its reader would read the probe)."""
    target = Path(path)
    try:
        if _is_stream(target):
            if stat.S_ISCHR(os.stat(target).st_mode):
                descriptor = os.open(target, os.O_WRONLY | os.O_NONBLOCK)
                try:
                    os.write(descriptor, b"")
                finally:
                    os.close(descriptor)
            return
        real = Path(os.path.realpath(target))
        descriptor, probe = _create_beside(real, ".probe")
        try:
            os.write(descriptor, b"{")
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
            os.unlink(probe)
    except OSError as err:
        raise ConfigError(
            f"cannot write --json {path}: {err.strerror or err} (checked before the benchmark runs); give a file "
            "in an existing folder this user may write, on a file system with free space"
        ) from None


def _create_beside(real: Path, suffix: str) -> tuple[int, Path]:
    """A new file of a fresh name in ``real``'s folder (mode 0666 less the umask, as a plain ``open`` makes it)."""
    for _ in range(100):
        candidate = real.with_name(f".{real.name}.{os.urandom(4).hex()}{suffix}")
        try:
            return os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), candidate
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(real.parent))


def write_json(report: dict, path: str | Path) -> None:
    """Write the report to ``path``; a write the storage refuses (a disk filled while the benchmark ran) is one line
    naming the file and the OS's reason, never a traceback after the whole run. A regular file is written whole
    beside its place and renamed over it, so a failed write leaves the user's earlier file as it was and no new
    file behind; a device or stream (``/dev/stdout``) is written directly."""
    data = json.dumps(report, indent=1).encode()
    target = Path(path)
    try:
        if _is_stream(target):
            with open(target, "ab") as stream:  # (appending: a log behind /dev/stdout keeps what was printed)
                stream.write(data)
            return
        real = Path(os.path.realpath(target))  # a link to a file stays a link: its file is replaced
        descriptor, staged = _create_beside(real, ".incomplete")
        try:
            with os.fdopen(descriptor, "wb") as staged_file:
                staged_file.write(data)
                staged_file.flush()
                os.fsync(staged_file.fileno())
            if real.exists():
                shutil.copymode(real, staged)  # the user's file keeps its permissions
            os.replace(staged, real)
        except BaseException:
            staged.unlink(missing_ok=True)
            raise
    except OSError as err:
        raise ConfigError(
            f"could not write --json {path}: {err.strerror or err}; the results are printed above (a file it held is "
            "left as it was): free space, or give another file"
        ) from None
