"""What a scenario returns, written as JSON by one process and compared in another.

Every value keeps the name of its type (``float``, ``ndarray``, ``float32``, ``list``, ...):
History holding numpy scalars where ``model.fit``'s holds floats is a difference too.

A scenario with a rounding baseline is judged against ``model.fit`` run again on inputs
nudged by ``NUDGE`` (each element times 1 + or - it): what float32 rounding alone moves in that
model (``rounding_differences``).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

Encoded = dict[str, Any]
NUDGE = 2**-20  # the baseline run's inputs, each times 1 + or - this: a change of float32 rounding's size
BASELINE_MULTIPLE = 10.0  # a difference up to this many times the baseline's is rounding


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


def relative_gap(left: Encoded, right: Encoded) -> float:
    """The largest difference between the numbers of two results of the same structure, relative
    to the largest magnitude in ``left`` (one scale for the whole result: a tensor that is only
    rounding noise, as a BatchNormalization beta before another one is, is not measured against itself).
    """
    mine, theirs = _numbers(left), _numbers(right)
    gaps = [_gap(a, b) for a, b in zip(mine, theirs, strict=True) if a.size]
    scale = max((np.max(np.abs(a[np.isfinite(a)]), initial=0.0) for a in mine), default=0.0)
    gap = max(gaps, default=0.0)
    return float(gap / scale) if scale > 0 else float(gap)


def _gap(a: np.ndarray, b: np.ndarray) -> float:
    """The largest difference; NaN against NaN is none, NaN against a number infinite."""
    both = np.isnan(a) & np.isnan(b)
    gap = np.where(both, 0.0, np.abs(a - b))
    return float(np.nan_to_num(np.max(gap), nan=np.inf))


def _numbers(value: Encoded) -> list[np.ndarray]:
    if "items" in value:
        items = value["items"].values() if isinstance(value["items"], dict) else value["items"]
        return [array for item in items for array in _numbers(item)]
    number = value["value"]
    if isinstance(number, bool | str) or number is None or (isinstance(number, list) and not _numeric(number)):
        return []
    return [np.asarray(number, dtype=np.float64)]


def _structure(value: Encoded) -> Encoded:
    """``value`` with every number zeroed: what is left to compare is types, keys, lengths, shapes, text."""
    if "items" in value:
        items = value["items"]
        if isinstance(items, dict):
            return {**value, "items": {key: _structure(item) for key, item in items.items()}}
        return {**value, "items": [_structure(item) for item in items]}
    return {**value, "value": 0} if _numbers(value) else value


def rounding_differences(
    left: Encoded,
    right: Encoded,
    baselines: list[tuple[Encoded, Encoded]],
    tolerance: dict[str, float],
    *,
    where: str = "result",
    multiple: float = BASELINE_MULTIPLE,
) -> list[str]:
    """Where ``right`` differs from ``left`` by more than rounding: each compared quantity (the
    result's top-level keys: weights, history, evaluate, predict, ...) is judged on its own,
    allowed ``multiple`` times the largest difference there of a baseline (a pair: ``model.fit``'s
    result, and the same on inputs times ``NUDGE``), or ``tolerance``, whichever is larger. Types, keys, lengths and
    text are compared exactly, as in ``differences``."""
    if "items" not in left or not isinstance(left["items"], dict):
        raise ValueError(f"{where}: a rounding baseline judges a result's quantities, a dict; got {left['type']}.")
    if exact := differences(_structure(left), _structure(right), tolerance, where):
        return exact
    found = []
    for key, mine in left["items"].items():
        place, theirs = f"{where}[{key!r}]", right["items"][key]
        beyond = differences(mine, theirs, tolerance, place)
        if not beyond:
            continue
        gap = relative_gap(mine, theirs)
        baseline = max((relative_gap(a["items"][key], b["items"][key]) for a, b in baselines), default=0.0)
        if gap <= multiple * baseline:
            continue
        times = f"{gap / baseline:.3g}x" if baseline > 0 else "infinitely many times"
        found.append(
            f"{place}: largest relative difference {gap:.2e}, {times} model.fit's own on inputs times "
            f"1 +- 2**-20 ({baseline:.2e}; up to {multiple:g}x is rounding); first: {beyond[0]}"
        )
    return found
