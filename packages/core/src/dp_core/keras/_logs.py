"""Logs as ``model.fit`` hands them to callbacks and History: flat, Python floats where a
value has one element, numpy arrays otherwise (vector metrics such as ``F1Score(average=None)``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
import numpy as np


def python_logs(logs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``logs`` with nested dicts flattened and values converted as Keras's ``pythonify_logs``
    does; lists (logs that crossed a process boundary as JSON) become arrays again.

    A value with axes stays an array even with one element (``F1Score()`` on one unit gives
    shape ``(1,)``): Keras's ``float(value)`` refuses those under numpy 2, and where it does
    not (Keras 3.10 on torch tensors) ``get_metrics_result`` has made them floats already.

    >>> python_logs({"loss": np.float32(0.5), "f1": [0.25, 0.75], "more": {"acc": np.array([1.0])}})
    {'f1': array([0.25, 0.75]), 'loss': 0.5, 'acc': array([1.])}
    """
    result: dict[str, Any] = {}
    for name, value in sorted((logs or {}).items()):
        if isinstance(value, Mapping):
            result.update(python_logs(value))
            continue
        array = np.asarray(value if isinstance(value, (list, tuple, np.ndarray)) else keras.ops.convert_to_numpy(value))
        result[name] = float(array) if array.ndim == 0 else array
    return result
