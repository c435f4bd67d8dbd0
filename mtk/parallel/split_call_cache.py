"""The cache a split call of a context-parallel model returns (:mod:`mtk.parallel.context`).

A split call computes each CP rank's own positions' keys only; gathering them would hold the whole rows' keys on
every rank, what CP saves. Where one process would return a cache, the call returns :class:`SplitCallCache`, which
holds none, and a later call given it is one line (it returned none before, and a hand-written loop decoded from
nothing)."""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import DynamicCache

from mtk.errors import ConfigError
from mtk.parallel.model_outputs import rebuilt_output
from mtk.parallel.sequence_padding import CACHE_KEYWORDS

__all__ = ["SplitCallCache", "refuse_split_call_cache", "with_cache_stand_in"]


class SplitCallCache(DynamicCache):
    """The cache a split call returns where one process would return one (``use_cache``, the config's default):
    it holds no keys (each CP rank computed its own positions' only, and gathering them would hold the whole rows'
    keys on every rank), and a call given it is one line instead of decoding from nothing. A call that is not
    training (eval mode, or without gradients) and asks for a cache (``use_cache=True``) runs whole and returns the
    whole rows' cache; ``generate`` runs its cached calls whole."""


def refuse_split_call_cache(module: Any, kwargs: dict[str, Any]) -> None:
    """One line where a call is given a :class:`SplitCallCache` (it would decode from no keys)."""
    if any(isinstance(kwargs.get(name), SplitCallCache) for name in CACHE_KEYWORDS):
        raise ConfigError(
            f"{type(module).__name__} is context-parallel: the cache given to this call came from a call split over "
            "the CP ranks, which keeps no keys; make the first call with use_cache=True in eval mode (it runs whole "
            "and returns the whole rows' cache), or decode with generate()"
        )


def with_cache_stand_in(output: Any) -> Any:
    """``output`` (a ``ModelOutput``) with a :class:`SplitCallCache` where one process's has its cache, rebuilt so
    that the field keeps HF's place in the tuple."""
    fields = {field.name for field in dataclasses.fields(output)} if dataclasses.is_dataclass(output) else set()
    name = next((n for n in CACHE_KEYWORDS if n in fields), None)
    if name is None or output.get(name) is not None:
        return output
    return rebuilt_output(output, **{name: SplitCallCache()})
