"""A transformers ``ModelOutput`` with a field set or removed, as HF would have built it.

Setting a field to ``None`` on a ``ModelOutput`` only clears the attribute: the dict entry stays, and
``out["logits"]``, ``out[1]`` and ``to_tuple()`` go on reading it. Setting a field that was ``None`` appends its
entry at the end, after fields HF places behind it. Rebuilding the output from its fields keeps HF's order and
leaves out what is ``None``, as ``to_tuple()`` then expects; an entry a hook added that is no field is kept.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["rebuilt_output"]


def rebuilt_output(output: Any, **changes: Any) -> Any:
    """``output`` with each of ``changes`` (a field name -> its value; ``None`` removes the field), rebuilt."""
    fields = {field.name for field in dataclasses.fields(output)}
    values = {**{key: value for key, value in output.items() if key in fields}, **changes}
    rebuilt = type(output)(**{key: value for key, value in values.items() if value is not None})
    for key, value in output.items():  # (an entry a hook added that is no field: kept as it was)
        if key not in fields:
            rebuilt[key] = value
    return rebuilt
