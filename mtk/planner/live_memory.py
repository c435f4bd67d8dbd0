"""The bytes of live tensors during a step, and the most at once: what ``max allocated`` is on CUDA, on any device.

torch's ``MemTracker`` also splits the bytes by kind, but follows modules through their forward and
backward (slow, and it refuses a module called twice in one step, which a pipeline does once per
micro-batch). This mode only follows storages: every tensor an operator returns is counted from its
creation until its storage is freed (a view of a counted storage adds nothing), on top of the tensors
given as present when the step starts. It works on the meta device too, where ``mtk plan`` runs it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["LiveMemory"]


class LiveMemory(TorchDispatchMode):
    """Counts live storage bytes by kind while active.

    ``peak``: the most bytes live at once; ``at_peak``: their split by kind then. Storages are of kind
    ``"other"`` unless :meth:`mark` (or ``present``) says otherwise; :meth:`mark_gradients` marks every
    gradient of a module as ``"grad"`` once it is accumulated.
    """

    def __init__(self, present: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._kind_of = WeakIdKeyDictionary()  # storage -> [kind, bytes]
        self.live: dict[str, int] = {}
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        for tensor in present:
            self.mark(tensor, "present")

    def mark(self, tensor: torch.Tensor, kind: str) -> None:
        """Count ``tensor``'s storage as ``kind`` from now on."""
        storage = tensor.untyped_storage()
        entry = self._kind_of.get(storage)
        if entry is None:
            entry = [kind, storage.nbytes()]
            self._kind_of[storage] = entry
            weakref.finalize(storage, self._free, entry)
        else:
            self.live[entry[0]] -= entry[1]
            entry[0] = kind
        self.live[kind] = self.live.get(kind, 0) + entry[1]
        total = sum(self.live.values())
        if total > self.peak:
            self.peak, self.at_peak = total, dict(self.live)

    def mark_gradients(self, module: torch.nn.Module) -> list:
        """Hooks that mark each trainable parameter's gradient as ``"grad"`` (remove them when done)."""
        return [
            p.register_post_accumulate_grad_hook(lambda p: self.mark(p.grad, "grad"))
            for p in module.parameters()
            if p.requires_grad
        ]

    def _free(self, entry: list) -> None:
        self.live[entry[0]] -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage() not in self._kind_of:
                self.mark(leaf, "other")
        return out

    @staticmethod
    def present_in(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The step's starting point: parameters, their gradients, the optimizer's state tensors."""
        tensors = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
        for state in optimizer.state.values():
            tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
        return tensors
