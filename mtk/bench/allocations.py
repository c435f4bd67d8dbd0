"""Where a CUDA step's peak allocations come from: the caching allocator's own trace
(``torch.cuda.memory._record_memory_history``) replayed to its highest point, the blocks live there grouped by
the frame of mtk or transformers that allocated them. A tensor-level counter (:mod:`mtk.planner.live_memory`)
cannot tell which kernel chose a larger path; this can (it found fp32 grouped-query attention on torch's math
path, docs/bench.md).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

__all__ = ["PeakAllocations", "peak_allocations"]

_OWN_CODE = ("/mtk/", "/transformers/")


@dataclass
class PeakAllocations:
    peak: int  # bytes allocated during the trace and live at its highest point
    by_frame: Counter[str]  # the same bytes by the first mtk / transformers frame that allocated them


def _frame_name(frames: list[dict]) -> str:
    for frame in frames:
        filename = frame.get("filename", "")
        for package in _OWN_CODE:
            if package in filename:
                where = filename.rsplit(package, 1)[-1]
                return f"{package.strip('/')}/{where}:{frame.get('line')} {frame.get('name')}"
    return "torch (no Python frame of mtk or transformers: autograd's backward, the optimizer)"


def peak_allocations(events: list[dict]) -> PeakAllocations:
    """Replay one device's trace (``snapshot["device_traces"][i]``): an ``alloc`` adds its block, the first
    ``free_requested`` / ``free_completed`` of it removes it."""
    live: dict[int, tuple[int, list[dict]]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, list[dict]]] = {}
    for event in events:
        action, address = event["action"], event["addr"]
        if action == "alloc":
            live[address] = (event["size"], event.get("frames", []))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action in ("free_requested", "free_completed") and address in live:
            total -= live.pop(address)[0]
    by_frame: Counter[str] = Counter()
    for size, frames in at_peak.values():
        by_frame[_frame_name(frames)] += size
    return PeakAllocations(peak, by_frame)
