"""Models and data for the equivalence check, importable by worker processes and by
``python -m torch_dp.check`` (as ``torch_equivalence_models:...``)."""

from __future__ import annotations

import keras
import numpy as np


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(160, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 1).astype("int64")
    return x, y


def _compiled(*layers: keras.layers.Layer) -> keras.Model:
    model = keras.Sequential([keras.Input((8,)), *layers, keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    return model


def exact_model() -> keras.Model:
    """Dense layers and SGD: N replicas train it as one, to float32 rounding."""
    return _compiled(keras.layers.Dense(16, activation="tanh"))


def dropout_model() -> keras.Model:
    """Each replica draws its own dropout masks: N replicas differ from one by design."""
    return _compiled(keras.layers.Dense(16, activation="tanh"), keras.layers.Dropout(0.5))
