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

    >>> python_logs({"loss": np.float32(0.5), "f1": [0.25, 0.75], "more": {"acc": np.array([1.0])}})
    {'f1': array([0.25, 0.75]), 'loss': 0.5, 'acc': 1.0}
    """
    result: dict[str, Any] = {}
    for name, value in sorted((logs or {}).items()):
        if isinstance(value, Mapping):
            result.update(python_logs(value))
            continue
        array = np.asarray(value if isinstance(value, (list, tuple, np.ndarray)) else keras.ops.convert_to_numpy(value))
        result[name] = float(array.reshape(())) if array.size == 1 else array
    return result
