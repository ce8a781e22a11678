"""The conformance scenarios: backend-neutral Keras code, deterministic data and weights.

Each scenario builds a compiled model, its data and the ``fit`` arguments. Initial kernels are
drawn with numpy (Keras initializers draw differently on each backend), so every backend and
replica count starts from the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np

import dp_core

NUM_SAMPLES = 99  # does not divide the global batch: the last batch is padded and masked
GLOBAL_BATCH_SIZE = 32
EPOCHS = 2


@dataclass(frozen=True)
class Scenario:
    name: str
    build: Callable[[], keras.Model]
    data: Callable[[], dict[str, Any]]
    fit_kwargs: dict[str, Any] = field(default_factory=dict)
    validation: Callable[[], tuple[Any, Any]] | None = None  # (x_val, y_val)
    validation_as_dataset: bool = False  # the trainers get it as a map-style dataset of rows


class RowDataset:
    """A map-style dataset of ``(x, y)`` rows, as a user's own dataset class would be."""

    def __init__(self, x: Any, y: Any) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        return self.x[index], self.y[index]


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(sum(map(ord, name)))


def deterministic_weights(model: keras.Model, name: str) -> list[np.ndarray]:
    """Keras's own constants (biases, BN statistics), numpy Glorot-uniform kernels."""
    rng = _rng(name)
    weights = []
    for variable, value in zip(model.weights, model.get_weights(), strict=True):
        if "kernel" in variable.path and value.ndim >= 2:
            fan_in, fan_out = int(np.prod(value.shape[:-1])), int(value.shape[-1])
            limit = np.sqrt(6.0 / (fan_in + fan_out))
            value = rng.uniform(-limit, limit, size=value.shape).astype(value.dtype)
        weights.append(value)
    return weights


def _mlp(
    optimizer: Callable[[], keras.optimizers.Optimizer],
    loss: str = "sparse_categorical_crossentropy",
    metrics: Callable[[], list[Any]] = lambda: ["accuracy"],
) -> Callable[[], keras.Model]:
    def build() -> keras.Model:
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(3, activation="softmax"),
            ]
        )
        model.compile(optimizer=optimizer(), loss=loss, metrics=metrics())
        return model

    return build


def _convnet() -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _two_in_two_out() -> keras.Model:
    left, right = keras.Input((4,), name="left"), keras.Input((3,), name="right")
    hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([left, right]))
    score = keras.layers.Dense(1, name="score")(hidden)
    label = keras.layers.Dense(2, activation="softmax", name="label")(hidden)
    model = keras.Model({"left": left, "right": right}, {"score": score, "label": label})
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss={"score": "mse", "label": "sparse_categorical_crossentropy"},
        loss_weights={"score": 0.5, "label": 1.0},
        metrics={"label": ["accuracy"], "score": ["mae"]},
    )
    return model


def _tabular(name: str) -> dict[str, Any]:
    rng = _rng(name)
    x = rng.normal(size=(NUM_SAMPLES, 6)).astype("float32")
    return {"x": x, "y": (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 1)}


def _images(name: str) -> dict[str, Any]:
    rng = _rng(name)
    x = rng.normal(size=(NUM_SAMPLES, 8, 8, 1)).astype("float32")
    return {"x": x, "y": (x.mean(axis=(1, 2, 3)) * 3 > 0).astype("int64") + (x[:, 0, 0, 0] > 1)}


def _two_inputs(name: str) -> dict[str, Any]:
    rng = _rng(name)
    left, right = rng.normal(size=(NUM_SAMPLES, 4)), rng.normal(size=(NUM_SAMPLES, 3))
    x = {"left": left.astype("float32"), "right": right.astype("float32")}
    y = {"score": (left.sum(1, keepdims=True) - right[:, :1]).astype("float32"), "label": (left[:, 0] > 0) * 1}
    return {"x": x, "y": y}


def _one_hot(name: str) -> dict[str, Any]:
    data = _tabular(name)
    data["y"] = np.eye(3, dtype="float32")[data["y"]]
    return data


def _validation_rows(name: str) -> Callable[[], tuple[Any, Any]]:
    def rows() -> tuple[Any, Any]:
        data = _tabular(name + "val")
        return data["x"][:45], data["y"][:45]  # 45 rows: a padded last batch too

    return rows


def _weighted(name: str) -> dict[str, Any]:
    data = _tabular(name)
    data["sample_weight"] = _rng(name + "w").uniform(0.0, 2.0, size=NUM_SAMPLES).astype("float32")
    return data


SCENARIOS = [
    Scenario("mlp_sgd", _mlp(lambda: keras.optimizers.SGD(0.1, momentum=0.9)), lambda: _tabular("mlp_sgd")),
    Scenario("mlp_adam", _mlp(lambda: keras.optimizers.Adam(1e-2)), lambda: _tabular("mlp_adam")),
    Scenario("convnet_batchnorm", _convnet, lambda: _images("convnet_batchnorm")),
    Scenario("two_inputs_two_outputs", _two_in_two_out, lambda: _two_inputs("two_inputs_two_outputs")),
    Scenario("sample_weight", _mlp(lambda: keras.optimizers.SGD(0.1)), lambda: _weighted("sample_weight")),
    Scenario(
        "lr_scaling_warmup",
        _mlp(lambda: keras.optimizers.SGD(0.05, momentum=0.9)),
        lambda: _tabular("lr_scaling_warmup"),
        {"lr_scaling": dp_core.linear_scaling(base_batch_size=16), "warmup_steps": 3},
    ),
    Scenario(
        "lr_scaling",
        _mlp(lambda: keras.optimizers.Adam(1e-2)),
        lambda: _tabular("lr_scaling"),
        {"lr_scaling": dp_core.sqrt_scaling(base_batch_size=8)},
    ),
    Scenario(
        "validation_dataset",
        _mlp(lambda: keras.optimizers.SGD(0.1)),
        lambda: _tabular("validation_dataset"),
        validation=_validation_rows("validation_dataset"),
        validation_as_dataset=True,
    ),
    Scenario(
        "vector_metric",
        _mlp(
            lambda: keras.optimizers.Adam(1e-2),
            loss="categorical_crossentropy",
            metrics=lambda: [keras.metrics.F1Score(average=None, threshold=0.4)],  # one value per class
        ),
        lambda: _one_hot("vector_metric"),
    ),
]
BY_NAME = {scenario.name: scenario for scenario in SCENARIOS}
