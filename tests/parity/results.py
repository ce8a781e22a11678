"""What a scenario returns, written as JSON by one process and compared in another.

Every value keeps the name of its type (``float``, ``ndarray``, ``float32``, ``list``, ...):
History holding numpy scalars where ``model.fit``'s holds floats is a difference too.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

Encoded = dict[str, Any]


def encode(value: Any) -> Encoded:
    kind = type(value).__name__
    if isinstance(value, dict):
        return {"type": kind, "items": {str(key): encode(item) for key, item in value.items()}}
    if isinstance(value, list | tuple):
        return {"type": kind, "items": [encode(item) for item in value]}
    if value is None or isinstance(value, bool | int | float | str):
        return {"type": kind, "value": value}
    array = np.asarray(keras.ops.convert_to_numpy(value))
    if array.dtype == object:  # not a number: compared by what it prints as
        return {"type": kind, "value": repr(value)}
    return {"type": kind, "dtype": str(array.dtype), "shape": list(array.shape), "value": array.ravel().tolist()}


def differences(left: Encoded, right: Encoded, tolerance: dict[str, float], where: str = "result") -> list[str]:
    """Every place where ``right`` differs from ``left``, each as one line naming the place."""
    if left["type"] != right["type"]:
        return [f"{where}: type {left['type']} vs {right['type']}"]
    if "items" in left:
        return _item_differences(left["items"], right["items"], tolerance, where)
    if "dtype" in left and (left["dtype"], left["shape"]) != (right["dtype"], right["shape"]):
        return [f"{where}: {left['dtype']}{left['shape']} vs {right['dtype']}{right['shape']}"]
    a, b = left["value"], right["value"]
    if isinstance(a, bool | str) or a is None or (isinstance(a, list) and not _numeric(a)):
        return [] if a == b else [f"{where}: {a!r} vs {b!r}"]
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if np.allclose(a, b, equal_nan=True, **tolerance):
        return []
    if a.ndim == 0:
        return [f"{where}: {a.item():.8g} vs {b.item():.8g}"]
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    gap = np.where(nan_a & nan_b, 0.0, np.where(nan_a | nan_b, np.inf, np.abs(a - b)))  # NaN vs a number: the worst
    worst = int(np.argmax(gap))
    count = int(np.sum(~np.isclose(a, b, equal_nan=True, **tolerance)))
    return [f"{where}: {count} of {a.size} values differ, worst at [{worst}]: {a[worst]:.8g} vs {b[worst]:.8g}"]


def _item_differences(a: Any, b: Any, tolerance: dict[str, float], where: str) -> list[str]:
    if isinstance(a, dict):
        if sorted(a) != sorted(b):
            return [f"{where}: keys {sorted(a)} vs {sorted(b)}"]
        pairs = [(f"{where}[{key!r}]", a[key], b[key]) for key in a]
    else:
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        pairs = [(f"{where}[{index}]", x, y) for index, (x, y) in enumerate(zip(a, b, strict=True))]
    return [line for place, x, y in pairs for line in differences(x, y, tolerance, place)]


def _numeric(values: list[Any]) -> bool:
    return all(isinstance(value, int | float) and not isinstance(value, bool) for value in values)
