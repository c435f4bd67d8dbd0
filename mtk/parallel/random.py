"""Named RNG streams for dropout under tensor parallelism (Megatron's RNG tracker).

Outside TP regions activations are replicated on every TP rank, so dropout there must draw the same
mask on all of them: that is torch's default generator, seeded identically across a TP group.
Inside TP regions (attention probabilities split by heads, activations split by columns) each rank
holds a different slice and must draw an independent mask: that is the ``tensor-parallel`` stream,
seeded with ``seed + 2718 + tp_rank``. ``tracker.fork()`` swaps the stream in for a block and puts the
default generator back afterwards, so the two streams advance independently.

States are saved and restored for the generator of the device the activations live on (the CPU
generator for CPU tensors, the CUDA generator for CUDA tensors); nothing here assumes a device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["TP_STREAM", "RNGStreams", "seed_everything_parallel"]

TP_STREAM = "tensor-parallel"
_TP_SEED_OFFSET = 2718


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


def _manual_seed(device: torch.device, seed: int) -> None:
    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.get_device_module(device.type).manual_seed(seed)


class RNGStreams:
    """A set of named generator states for one device, swapped in with :meth:`fork`."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed`` without disturbing the current generator."""
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        saved = _get_state(self.device)
        _manual_seed(self.device, seed)
        self._states[name] = _get_state(self.device)
        _set_state(self.device, saved)

    @contextmanager
    def fork(self, name: str = TP_STREAM) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default generator resumes afterwards."""
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} was never added; known streams: {sorted(self._states)}")
        saved = _get_state(self.device)
        _set_state(self.device, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device)
            _set_state(self.device, saved)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every stream's state, for whoever checkpoints these streams (resume must continue each exactly);
        mtk's own checkpoints store the default generators only (rng/rank*.pt)."""
        return {name: state.clone() for name, state in self._states.items()}

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {name: state.clone() for name, state in states.items()}


def seed_everything_parallel(seed: int, tp_rank: int, device: torch.device | str = "cpu") -> RNGStreams:
    """Seed the default generators with ``seed`` (same on all TP ranks) and add the TP stream.

    Returns the streams object whose :meth:`RNGStreams.fork` wraps dropout inside TP regions.
    """
    torch.manual_seed(seed)  # CPU and every accelerator's default generator
    streams = RNGStreams(device)
    streams.add(TP_STREAM, seed + _TP_SEED_OFFSET + tp_rank)
    return streams
