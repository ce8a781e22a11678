"""Metrics whose result has a shape: fit and evaluate give what ``model.fit``/``evaluate`` give,
History holding the same values of the same type."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from jax_dp_helpers import NUM_SAMPLES, assert_same_run, keras_run, trainer_run

pytestmark = pytest.mark.timeout(240)


def binary_classifier() -> keras.Model:
    keras.utils.set_random_seed(1)
    layers = [keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1, activation="sigmoid")]
    model = keras.Sequential(layers)
    metrics = [
        keras.metrics.F1Score(threshold=0.5, name="f1"),  # one unit: a result of shape (1,)
        keras.metrics.F1Score(average="macro", threshold=0.5, name="f1_macro"),  # shape ()
    ]
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy", metrics=metrics)
    return model


def test_metric_results_of_any_shape_equal_keras(data):
    x = data[0]
    y = (x[:, :1] + 0.3 * np.random.default_rng(4).normal(size=(NUM_SAMPLES, 1)) > 0).astype("float32")

    expected, initial = keras_run(binary_classifier, x, y)
    actual = trainer_run(binary_classifier, initial, x, y)

    assert np.shape(expected.history["f1"][0]) == (1,)  # what Keras's History holds: arrays of shape (1,)
    assert_same_run(expected, actual)
