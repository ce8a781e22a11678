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
    """An unseeded Dropout (torch's own generator) and a seeded one: every replica draws the global
    batch's masks and keeps its rows, so N replicas train it as one."""
    return _compiled(
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dropout(0.3, seed=4),
    )


def batch_norm_model() -> keras.Model:
    """With batch_norm="per_replica", each replica normalizes its own rows: differs by design."""
    return _compiled(
        keras.layers.Dense(16, use_bias=False), keras.layers.BatchNormalization(), keras.layers.Activation("tanh")
    )
