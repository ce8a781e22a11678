"""The comparison the matrix rests on: it sees types, keys, lengths and values beyond tolerance."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parity.results import differences, encode, rounding_differences
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


def _through_json(value):
    return json.loads(json.dumps(encode(value)))


def _judged(keras_result, trainer_result, nudged_result):
    keras_result, trainer_result, nudged_result = map(_through_json, (keras_result, trainer_result, nudged_result))
    return rounding_differences(keras_result, trainer_result, [(keras_result, nudged_result)], FP32, where="r")


def _result(weight, loss, prediction):
    return {
        "weights": [np.array([2.0, weight], "float32")],
        "history": {"loss": [1.0, loss]},
        "predict": np.array([[4.0, prediction]], "float32"),
    }


def test_a_difference_within_ten_times_the_nudged_runs_is_rounding():
    # the nudged run moves each quantity by 1e-3 (relative): the trainer's 9e-3 is rounding
    keras_result, nudged = _result(1.0, 0.5, 2.0), _result(1.002, 0.5005, 2.004)
    assert _judged(keras_result, _result(1.018, 0.5045, 2.036), nudged) == []


def test_each_quantity_is_judged_against_its_own_baseline_and_the_message_shows_both_numbers():
    # weights moved 10x more than predictions in the nudged run; that does not excuse predict
    keras_result, nudged = _result(1.0, 0.5, 2.0), _result(1.0625, 0.5005, 2 + 2**-8)
    found = _judged(keras_result, _result(1.25, 0.5, 2.125), nudged)
    assert found == [
        "r['predict']: largest relative difference 3.12e-02, 32x model.fit's own on inputs times 1 +- 2**-20 "
        "(9.77e-04; up to 10x is rounding); first: r['predict']: 1 of 2 values differ, worst at [1]: 2 vs 2.125"
    ]


def test_with_no_baseline_difference_only_the_tolerance_is_rounding():
    keras_result = _result(1.0, 0.5, 2.0)
    assert _judged(keras_result, _result(1.0 + 1e-6, 0.5, 2.0), keras_result) == []
    found = _judged(keras_result, _result(1.001, 0.5, 2.0), keras_result)
    assert len(found) == 1
    assert found[0].startswith("r['weights']: largest relative difference 5.00e-04, infinitely many times")


def test_the_difference_is_measured_against_the_whole_quantitys_largest_magnitude():
    # a tensor of rounding noise (a beta before another BatchNormalization) is not measured against itself
    keras_result = {"weights": [np.array([400.0, 100.0], "float32"), np.array([0.01], "float32")]}
    nudged = {"weights": [np.array([400.0, 100.5], "float32"), np.array([0.011], "float32")]}
    trainer = {"weights": [np.array([400.0, 100.0], "float32"), np.array([-0.02], "float32")]}
    assert _judged(keras_result, trainer, nudged) == []
    trainer = {"weights": [np.array([400.0, 125.0], "float32"), np.array([0.01], "float32")]}
    found = _judged(keras_result, trainer, nudged)
    assert [line.split(",")[0] for line in found] == ["r['weights']: largest relative difference 6.25e-02"]


def test_nan_equals_nan_and_differs_from_a_number():
    history = {"loss": [0.5, float("nan")], "w": [np.array([np.nan, 1.0], "float32")]}
    assert _both(history, {"loss": [0.5, float("nan")], "w": [np.array([np.nan, 1.0], "float32")]}) == []
    assert _both({"loss": [float("nan")]}, {"loss": [0.5]}) == ["r['loss'][0]: nan vs 0.5"]
    found = _both({"w": [np.array([np.nan, 1.0], "float32")]}, {"w": [np.array([1.0, 1.0], "float32")]})
    assert found == ["r['w'][0]: 1 of 2 values differ, worst at [0]: nan vs 1"]
