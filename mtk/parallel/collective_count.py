"""Count the collectives a piece of code issues, by kind and bytes.

Tests use it to prove the communication the math requires and no more (one all-reduce forward and
one backward per Column->Row pair); ``mtk bench`` prints it next to the predicted counts. It wraps
the public ``torch.distributed`` entry points for the duration of a ``with`` block, so it sees mtk's
collectives and anybody else's (HF, DeepSpeed) alike. Nested calls (one entry point implemented
with another) are counted once, at the outermost call.
"""

from __future__ import annotations

import inspect
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["CollectiveEvent", "CollectiveLog", "count_collectives"]

# entry point -> (kind it is reported as, index of the tensor argument whose size is reported)
_TRACED = {
    "all_reduce": ("all_reduce", 0),
    "all_gather_single": ("all_gather", 1),
    "all_gather_into_tensor": ("all_gather", 1),
    "all_gather": ("all_gather", 1),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "reduce_scatter": ("reduce_scatter", 0),
    "broadcast": ("broadcast", 0),
    "reduce": ("reduce", 0),
    "all_to_all_single": ("all_to_all", 1),
    "send": ("send", 0),
    "recv": ("recv", 0),
    "isend": ("send", 0),
    "irecv": ("recv", 0),
    "barrier": ("barrier", None),
}


@dataclass(frozen=True)
class CollectiveEvent:
    """One collective call: its kind, the elements and bytes of the tensor it was given."""

    kind: str
    numel: int
    nbytes: int


@dataclass
class CollectiveLog:
    """Events recorded inside one :func:`count_collectives` block, in call order."""

    events: list[CollectiveEvent] = field(default_factory=list)

    def counts(self) -> Counter:
        """Number of calls per kind, e.g. ``{"all_reduce": 2}``."""
        return Counter(e.kind for e in self.events)

    def bytes_by_kind(self) -> Counter:
        total: Counter = Counter()
        for e in self.events:
            total[e.kind] += e.nbytes
        return total

    def of(self, kind: str) -> list[CollectiveEvent]:
        return [e for e in self.events if e.kind == kind]

    def clear(self) -> None:
        self.events.clear()


def _tensor_size(value) -> tuple[int, int]:
    if isinstance(value, torch.Tensor):
        return value.numel(), value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        sizes = [_tensor_size(v) for v in value]
        return sum(s[0] for s in sizes), sum(s[1] for s in sizes)
    return 0, 0


@contextmanager
def count_collectives() -> Iterator[CollectiveLog]:
    """Record every torch.distributed collective issued inside the block (this process only)."""
    log = CollectiveLog()
    local = threading.local()
    originals = {name: getattr(dist, name) for name in _TRACED if hasattr(dist, name)}

    def wrap(name, fn):
        kind, arg_index = _TRACED[name]
        parameters = list(inspect.signature(fn).parameters)
        name_of_arg = parameters[arg_index] if arg_index is not None and arg_index < len(parameters) else None

        def traced(*args, **kwargs):
            depth = getattr(local, "depth", 0)
            if depth == 0:
                tensor = args[arg_index] if arg_index is not None and len(args) > arg_index else None
                if tensor is None and name_of_arg is not None:  # passed by name (FSDP2: output=..., input=...)
                    tensor = kwargs.get(name_of_arg)
                numel, nbytes = _tensor_size(tensor)
                log.events.append(CollectiveEvent(kind, numel, nbytes))
            local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                local.depth = depth

        return traced

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield log
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
