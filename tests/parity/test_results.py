"""The comparison the matrix rests on: it sees types, keys, lengths and values beyond tolerance."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parity.results import differences, encode
from parity.scenarios import FP32


def _both(left, right):
    # through JSON, as between run.py and the test
    return differences(json.loads(json.dumps(encode(left))), json.loads(json.dumps(encode(right))), FP32, "r")


def test_equal_within_tolerance_is_no_difference():
    weights = [np.linspace(-1, 1, 6, dtype="float32").reshape(2, 3)]
    history = {"loss": [0.5, 0.25], "f1": [np.array([0.5], "float32")]}
    assert _both({"w": weights, "h": history}, {"w": [weights[0] + 1e-7], "h": history}) == []


def test_a_value_beyond_tolerance_names_its_place_and_the_worst_element():
    found = _both({"w": [np.zeros(4, "float32")]}, {"w": [np.array([0, 0, 1e-3, 0], "float32")]})
    assert found == ["r['w'][0]: 1 of 4 values differ, worst at [2]: 0 vs 0.001"]


def test_types_keys_lengths_dtypes_and_exact_values_differ():
    assert _both({"loss": [0.5]}, {"loss": [np.float32(0.5)]}) == ["r['loss'][0]: type float vs float32"]
    assert _both({"loss": [0.5]}, {"loss": [0.5], "val_loss": [0.4]}) == ["r: keys ['loss'] vs ['loss', 'val_loss']"]
    assert _both({"epochs": [0, 1]}, {"epochs": [0]}) == ["r['epochs']: length 2 vs 1"]
    assert _both(np.zeros(2, "float32"), np.zeros(2, "float16")) == ["r: float32[2] vs float16[2]"]
    assert _both({"names": "a.h5"}, {"names": "b.h5"}) == ["r['names']: 'a.h5' vs 'b.h5'"]


def test_nan_equals_nan_and_differs_from_a_number():
    history = {"loss": [0.5, float("nan")], "w": [np.array([np.nan, 1.0], "float32")]}
    assert _both(history, {"loss": [0.5, float("nan")], "w": [np.array([np.nan, 1.0], "float32")]}) == []
    assert _both({"loss": [float("nan")]}, {"loss": [0.5]}) == ["r['loss'][0]: nan vs 0.5"]
    found = _both({"w": [np.array([np.nan, 1.0], "float32")]}, {"w": [np.array([1.0, 1.0], "float32")]})
    assert found == ["r['w'][0]: 1 of 2 values differ, worst at [0]: nan vs 1"]
