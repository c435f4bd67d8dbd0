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

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = [
    "DEFAULT_STREAM",
    "TP_SEED_OFFSET",
    "TP_STREAM",
    "ForkAround",
    "RNGStreams",
    "recompute_context",
    "seed_everything_parallel",
]

DEFAULT_STREAM = "default"
TP_STREAM = "tensor-parallel"
TP_SEED_OFFSET = 2718  # Megatron's offset between the shared seed and the per-TP-rank one


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
    """Named generator states for one device; :meth:`fork` makes one of them the live generator.

    The live generator belongs to one stream at a time (``active``, at first :data:`DEFAULT_STREAM`:
    torch's default generator as the user seeded it); the others are parked here. Forks nest, and a
    fork to the stream already active is a no-op, so a replicated dropout inside a TP region can
    fork back to the default stream.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}  # parked streams (never the active one)
        self.active = DEFAULT_STREAM

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed`` without disturbing the current generator."""
        if name in self._states or name in (self.active, DEFAULT_STREAM):
            raise ValueError(f"RNG stream {name!r} already exists")
        saved = _get_state(self.device)
        _manual_seed(self.device, seed)
        self._states[name] = _get_state(self.device)
        _set_state(self.device, saved)

    def reseed(self, name: str, seed: int) -> None:
        """Seed the parked stream ``name`` again with ``seed`` (as :meth:`add` did)."""
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} is not parked here; parked streams: {sorted(self._states)}")
        del self._states[name]
        self.add(name, seed)

    @contextmanager
    def fork(self, name: str = TP_STREAM) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the stream active before resumes afterwards."""
        if name == self.active:
            yield
            return
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} was never added; known streams: {self.names()}")
        previous = self.active
        self._states[previous] = _get_state(self.device)
        _set_state(self.device, self._states.pop(name))
        self.active = name
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device)
            _set_state(self.device, self._states.pop(previous))
            self.active = previous

    def names(self) -> list[str]:
        return sorted({*self._states, self.active})

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The parked streams' states (not the default generator, which is saved on its own); resume
        must continue each exactly. Called outside any fork."""
        if self.active != DEFAULT_STREAM:
            raise RuntimeError(f"RNG streams saved inside a fork of {self.active!r}")
        return {name: state.clone() for name, state in self._states.items()}

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        if self.active != DEFAULT_STREAM:
            raise RuntimeError(f"RNG streams loaded inside a fork of {self.active!r}")
        self._states = {name: state.clone() for name, state in states.items()}


class ForkAround:
    """Forward pre-hook + always-called forward hook that run a module under one stream.

    Registered on the attention modules (random draws on split heads: the TP stream) and, under
    sequence parallelism, on whole transformer blocks; the default stream is forked back around
    a residual dropout inside a TP-forked module when its input is replicated.
    """

    def __init__(self, streams: RNGStreams, name: str) -> None:
        self.streams, self.name = streams, name
        self._open: list[contextlib.AbstractContextManager] = []

    def register(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._exit, always_call=True)

    def _enter(self, module: nn.Module, args: tuple) -> None:
        context = self.streams.fork(self.name)
        context.__enter__()
        self._open.append(context)

    def _exit(self, module: nn.Module, args: tuple, output: object) -> None:
        self._open.pop().__exit__(None, None, None)


def recompute_context(
    streams: RNGStreams,
) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``context_fn`` for ``torch.utils.checkpoint``: the recomputed forward draws what the first did.

    torch restores the live generator for the recompute; this restores the parked streams (the TP
    stream a fork inside the checkpointed block swaps in), then puts the current ones back.
    """
    snapshot: dict[str, torch.Tensor] = {}

    @contextmanager
    def remember() -> Iterator[None]:
        snapshot.update(streams._states)  # tensors are replaced, never mutated: no copy needed
        yield

    @contextmanager
    def replay() -> Iterator[None]:
        current = dict(streams._states)
        # Only streams parked then and now: a fork entered outside the checkpoint (a whole block
        # under sequence parallelism) is in the live generator, which torch itself restores.
        streams._states.update({name: state for name, state in snapshot.items() if name in current})
        try:
            yield
        finally:
            streams._states.update(current)

    return remember(), replay()


def seed_everything_parallel(seed: int, tp_rank: int, device: torch.device | str = "cpu") -> RNGStreams:
    """Seed the default generators with ``seed`` (same on all TP ranks) and add the TP stream.

    Returns the streams object whose :meth:`RNGStreams.fork` wraps dropout inside TP regions.
    """
    torch.manual_seed(seed)  # CPU and every accelerator's default generator
    streams = RNGStreams(device)
    streams.add(TP_STREAM, seed + TP_SEED_OFFSET + tp_rank)
    return streams
