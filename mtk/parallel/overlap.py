"""Average gradients over data-parallel replicas while backward is still running (DDP's overlap, for
models DDP cannot wrap: a pipeline stage runs several forwards before its backwards).

Parameters are grouped into buckets in reverse order (roughly the order backward produces their
gradients), one dtype per bucket, up to ``bucket_bytes``. Once armed for the last backward of an
optimizer step, a hook on each parameter notes when its gradient is final; when a bucket's last one is,
the bucket's gradients are flattened and all-reduced asynchronously, overlapping the rest of backward.
:meth:`OverlappedReduction.finish` launches what never filled (parameters that got no gradient), waits
for every bucket in launch order and writes the averages back. Every DP replica runs the same graph, so
buckets complete, and their collectives are issued, in the same order on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mtk.parallel.comm import Group, group_size

__all__ = ["BUCKET_BYTES", "OverlappedReduction", "gradient_buckets"]

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


def gradient_buckets(sizes: list[tuple[int, torch.dtype]], bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices of ``(nbytes, dtype)`` entries per bucket: last entry first, one dtype per bucket, at most
    ``bucket_bytes`` each (one bigger entry gets a bucket of its own)."""
    buckets: list[list[int]] = []
    filled: dict[torch.dtype, tuple[int, int]] = {}  # dtype -> (open bucket index, bytes in it)
    for index in reversed(range(len(sizes))):
        nbytes, dtype = sizes[index]
        open_bucket = filled.get(dtype)
        if open_bucket is None or open_bucket[1] + nbytes > bucket_bytes and open_bucket[1] > 0:
            buckets.append([])
            open_bucket = (len(buckets) - 1, 0)
        buckets[open_bucket[0]].append(index)
        filled[dtype] = (open_bucket[0], open_bucket[1] + nbytes)
    return buckets


class OverlappedReduction:
    """Gradients of ``params`` averaged over ``group``, bucket by bucket, from inside backward."""

    def __init__(self, params: list[nn.Parameter], group: Group, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.group = group
        self.params = [p for p in params if p.requires_grad]
        sizes = [(p.numel() * p.element_size(), p.dtype) for p in self.params]
        self.buckets = gradient_buckets(sizes, bucket_bytes)
        self._bucket_of = {id(self.params[i]): b for b, bucket in enumerate(self.buckets) for i in bucket}
        self._waiting = [len(bucket) for bucket in self.buckets]
        self._launched: list[tuple[int, dist.Work | None, torch.Tensor]] = []
        self._hooks: list = []

    @property
    def launched(self) -> int:
        """Buckets whose all-reduce has started."""
        return len(self._launched)

    def arm(self, params: list[nn.Parameter] | None = None) -> None:
        """From now on, the next accumulated gradient of each of ``params`` (default: all) is final for this
        step (a pipeline rank with several model chunks arms each chunk before its last backward)."""
        if group_size(self.group) == 1:
            return
        mine = {id(p) for p in self.params}
        chosen = self.params if params is None else [p for p in params if id(p) in mine]
        self._hooks += [p.register_post_accumulate_grad_hook(self._ready) for p in chosen]

    def _ready(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        self._waiting[bucket] -= 1
        if self._waiting[bucket] == 0:
            self._launch(bucket)

    def _launch(self, bucket: int) -> None:
        present = [g for g in (self.params[i].grad for i in self.buckets[bucket]) if g is not None]
        flat = torch.cat([g.reshape(-1) for g in present]) if present else torch.zeros(0)
        work = dist.all_reduce(flat, group=self.group, async_op=True) if present else None
        self._launched.append((bucket, work, flat))

    def finish(self) -> None:
        """Launch the buckets that never filled, wait for all, write the averages into ``.grad``."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        size = group_size(self.group)
        if size == 1:
            return
        done = {bucket for bucket, _, _ in self._launched}
        for bucket in range(len(self.buckets)):
            if bucket not in done:
                self._launch(bucket)
        for bucket, work, flat in self._launched:
            if work is None:
                continue
            work.wait()
            flat.div_(size)
            present = [g for g in (self.params[i].grad for i in self.buckets[bucket]) if g is not None]
            for grad, chunk in zip(present, flat.split([g.numel() for g in present])):
                grad.copy_(chunk.view_as(grad))
        self._launched = []
