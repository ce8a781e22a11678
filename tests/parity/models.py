"""Tiny models and data for the parity scenarios, the same numbers on every backend.

Keras initializers draw differently on torch and jax, so every kernel-like weight (2-D and
up: kernels, recurrent kernels, embeddings) is drawn with numpy from the scenario's name;
1-D weights keep Keras's constants (zero biases, LSTM forget-gate ones, BatchNorm statistics).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np

NUM_SAMPLES = 99  # 32 + 32 + 32 + 3: the last global batch is padded on 2 replicas
BATCH_SIZE = 32
EPOCHS = 2


def rng(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def numpy_weights(model: keras.Model, name: str) -> keras.Model:
    """``model`` with numpy Glorot-uniform values in every weight of 2 or more dimensions."""
    draw = rng(name + "/weights")
    weights = []
    for value in model.get_weights():
        if value.ndim >= 2 and np.issubdtype(value.dtype, np.floating):
            fan_in, fan_out = int(np.prod(value.shape[:-1])), int(value.shape[-1])
            limit = np.sqrt(6.0 / (fan_in + fan_out))
            value = draw.uniform(-limit, limit, size=value.shape).astype(value.dtype)
        weights.append(value)
    model.set_weights(weights)
    return model


# ---- data -------------------------------------------------------------------------------


def tabular(name: str, num_samples: int = NUM_SAMPLES) -> tuple[np.ndarray, np.ndarray]:
    """6 features, 3 classes."""
    x = rng(name).normal(size=(num_samples, 6)).astype("float32")
    return x, ((x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 1))


def binary(name: str) -> tuple[np.ndarray, np.ndarray]:
    """6 features, a (N, 1) float 0/1 label."""
    x = rng(name).normal(size=(NUM_SAMPLES, 6)).astype("float32")
    return x, (x[:, :1] - 0.5 * x[:, 1:2] > 0.2).astype("float32")


def images(name: str) -> tuple[np.ndarray, np.ndarray]:
    """8x8 one-channel images, 3 classes."""
    x = rng(name).normal(size=(NUM_SAMPLES, 8, 8, 1)).astype("float32")
    return x, (x.mean(axis=(1, 2, 3)) * 3 > 0).astype("int64") + (x[:, 0, 0, 0] > 1)


def pixel_classes(name: str) -> tuple[np.ndarray, np.ndarray]:
    """8x8 images and a class per pixel: y (N, 8, 8) over a (N, 8, 8, 3) output."""
    x = rng(name).normal(size=(NUM_SAMPLES, 8, 8, 1)).astype("float32")
    return x, (x[..., 0] > -0.4).astype("int64") + (x[..., 0] > 0.6)


def binary_masks(name: str) -> tuple[np.ndarray, np.ndarray]:
    """8x8 images and a 0/1 mask per pixel, (N, 8, 8, 1) floats."""
    x = rng(name).normal(size=(NUM_SAMPLES, 8, 8, 1)).astype("float32")
    return x, (x > 0.3).astype("float32")


def token_sequences(name: str, length: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """Token ids 1..9 padded with trailing 0s (lengths 2..7), and a class per timestep."""
    draw = rng(name)
    tokens = draw.integers(1, 10, size=(NUM_SAMPLES, length))
    lengths = draw.integers(2, length + 1, size=NUM_SAMPLES)
    tokens[np.arange(length) >= lengths[:, None]] = 0
    return tokens.astype("int64"), (tokens % 3).astype("int64")


def two_inputs(name: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    draw = rng(name)
    left = draw.normal(size=(NUM_SAMPLES, 4)).astype("float32")
    right = draw.normal(size=(NUM_SAMPLES, 3)).astype("float32")
    score = (left.sum(1, keepdims=True) - right[:, :1]).astype("float32")
    return {"left": left, "right": right}, {"score": score, "label": (left[:, 0] > 0).astype("int64")}


def weights_for(name: str, low: float = 0.0, high: float = 2.0) -> np.ndarray:
    return rng(name + "/sample_weight").uniform(low, high, size=NUM_SAMPLES).astype("float32")


def batches(parts: tuple[Any, ...], batch_size: int = BATCH_SIZE) -> list[tuple[Any, ...]]:
    """The global batches of ``parts`` in row order; the last one is short."""
    rows = len(keras.tree.flatten(parts[0])[0])
    return [
        tuple(keras.tree.map_structure(lambda array, at=start: array[at : at + batch_size], part) for part in parts)
        for start in range(0, rows, batch_size)
    ]


def cycle(parts: tuple[Any, ...], batch_size: int = BATCH_SIZE) -> Iterator[tuple[Any, ...]]:
    """An endless generator of global batches, as users write for ``steps_per_epoch``."""
    while True:
        yield from batches(parts, batch_size)


class RowDataset:
    """A map-style dataset of ``(x, y)`` rows, as a user's own dataset class would be."""

    def __init__(self, x: Any, y: Any) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        return self.x[index], self.y[index]


class BatchDataset(keras.utils.PyDataset):
    """A ``PyDataset`` whose items are global batches (the last one short)."""

    def __init__(self, *parts: Any) -> None:
        super().__init__()
        self.items = batches(parts)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        return self.items[index]


# ---- models -----------------------------------------------------------------------------


def mlp(
    name: str,
    *,
    middle: Callable[[], list[keras.layers.Layer]] = list,
    outputs: int = 3,
    activation: str = "softmax",
    optimizer: Callable[[], keras.optimizers.Optimizer] = lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    loss: Any = "sparse_categorical_crossentropy",
    metrics: Any = ("accuracy",),
    **compile_arguments: Any,
) -> keras.Model:
    """6 -> 8 (relu) -> [middle] -> ``outputs``, compiled, numpy weights from ``name``."""
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            *middle(),
            keras.layers.Dense(outputs, activation=activation),
        ]
    )
    metrics = list(metrics) if isinstance(metrics, tuple) else metrics
    model.compile(optimizer=optimizer(), loss=loss, metrics=metrics, **compile_arguments)
    return numpy_weights(model, name)


def two_in_two_out(name: str, **compile_arguments: Any) -> keras.Model:
    """Named inputs ``left``/``right``, named outputs ``score`` (mse) and ``label`` (2 classes)."""
    left, right = keras.Input((4,), name="left"), keras.Input((3,), name="right")
    hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([left, right]))
    outputs = {
        "score": keras.layers.Dense(1, name="score")(hidden),
        "label": keras.layers.Dense(2, activation="softmax", name="label")(hidden),
    }
    model = keras.Model({"left": left, "right": right}, outputs)
    compile_arguments = {
        "optimizer": keras.optimizers.SGD(0.05, momentum=0.9),
        "loss": {"score": "mse", "label": "sparse_categorical_crossentropy"},
        "loss_weights": {"score": 0.5, "label": 1.0},
        "metrics": {"label": ["accuracy"], "score": ["mae"]},
        **compile_arguments,
    }
    model.compile(**compile_arguments)
    return numpy_weights(model, name)


def two_positional_inputs(name: str) -> keras.Model:
    """Two unnamed inputs, fed as a tuple ``(a, b)``."""
    a, b = keras.Input((4,)), keras.Input((3,))
    hidden = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([a, b]))
    model = keras.Model([a, b], keras.layers.Dense(2, activation="softmax")(hidden))
    model.compile(keras.optimizers.Adam(1e-2), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return numpy_weights(model, name)


def convnet(name: str) -> keras.Model:
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
    model.compile(keras.optimizers.Adam(1e-2), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return numpy_weights(model, name)


def pixelwise(name: str, *, classes: int, activation: str | None, loss: Any, metrics: Any = ()) -> keras.Model:
    """A 2-layer fully convolutional net: one prediction per pixel."""
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(classes, 1, activation=activation),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-2), loss, metrics=list(metrics))
    return numpy_weights(model, name)


def masked_sequence(name: str, *, recurrent: bool) -> keras.Model:
    """Embedding(mask_zero=True), an optional LSTM, then a class per timestep."""
    layers = [keras.Input((None,), dtype="int64"), keras.layers.Embedding(10, 4, mask_zero=True)]
    if recurrent:
        layers.append(keras.layers.LSTM(6, return_sequences=True))
    layers.append(keras.layers.Dense(3, activation="softmax"))
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.Adam(1e-2), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return numpy_weights(model, name)


@keras.saving.register_keras_serializable(package="parity")
class ActivityPenalty(keras.layers.Layer):
    """Adds ``rate * mean(x**2)`` over the batch with ``add_loss``: a loss no label knows about."""

    def __init__(self, rate: float = 0.01, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rate = rate

    def call(self, inputs: Any) -> Any:
        self.add_loss(self.rate * keras.ops.mean(keras.ops.square(inputs)))
        return inputs

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "rate": self.rate}


def mlp_with_add_loss() -> keras.Model:
    """A factory (module level, so a spawned worker can import it with the layer registered)."""
    return mlp("add_loss", middle=lambda: [ActivityPenalty(0.05)])
