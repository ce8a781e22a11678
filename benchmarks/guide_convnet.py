"""The models and synthetic data every benchmark uses, in backend-neutral Keras.

The Keras guides' MNIST convnet (``keras.io/examples/vision/mnist_convnet``) on random
data of MNIST's shape, the BatchNorm convnet of the Keras distributed-training guides,
and a linear classifier on wide rows for the memory runs. The
benchmark scripts set ``KERAS_BACKEND`` before importing this module.
"""

from __future__ import annotations

import keras
import numpy as np

NUM_CLASSES = 10
MEMORY_COLUMNS = 4096  # 16 KiB float32 rows: 65,536 of them are exactly 1 GiB


def mnist_convnet(logits: bool = False) -> keras.Model:
    """The guides' convnet, seeded so every run starts from the same weights."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
            keras.layers.MaxPooling2D(pool_size=(2, 2)),
            keras.layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
            keras.layers.MaxPooling2D(pool_size=(2, 2)),
            keras.layers.Flatten(),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(NUM_CLASSES, activation=None if logits else "softmax"),
        ]
    )


def compiled_convnet(*, one_hot: bool = False, metrics: tuple[str, ...] = ("accuracy",)) -> keras.Model:
    """The convnet compiled as in the guide: adam, cross-entropy (sparse unless ``one_hot``)."""
    model = mnist_convnet()
    loss = "categorical_crossentropy" if one_hot else "sparse_categorical_crossentropy"
    model.compile(optimizer="adam", loss=loss, metrics=list(metrics))
    return model


def synthetic_mnist(num_samples: int, *, one_hot: bool = False, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Uniform float32 images (N, 28, 28, 1) and random labels, int64 or one-hot float32."""
    rng = np.random.default_rng(seed)
    x = rng.random((num_samples, 28, 28, 1), dtype=np.float32)
    labels = rng.integers(0, NUM_CLASSES, num_samples)
    y = np.eye(NUM_CLASSES, dtype=np.float32)[labels] if one_hot else labels.astype("int64")
    return x, y


def wide_rows(num_rows: int, num_columns: int = MEMORY_COLUMNS) -> tuple[np.ndarray, np.ndarray]:
    """A large array dataset: ``num_rows`` float32 rows of ``num_columns`` and int64 labels."""
    rng = np.random.default_rng(1)
    x = rng.random((num_rows, num_columns), dtype=np.float32)
    return x, rng.integers(0, NUM_CLASSES, num_rows).astype("int64")


def linear_classifier(num_columns: int = MEMORY_COLUMNS) -> keras.Model:
    """A model cheap enough that a memory run is about the data, not the compute."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((num_columns,)), keras.layers.Dense(NUM_CLASSES, activation="softmax")])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def batchnorm_convnet(
    batch_norm: type[keras.layers.BatchNormalization] = keras.layers.BatchNormalization,
) -> keras.Model:
    """The convnet of keras.io/guides/distributed_training_with_torch (logits out), seeded."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(28, 28, 1))
    x = keras.layers.Rescaling(1.0 / 255.0)(inputs)
    x = keras.layers.Conv2D(filters=12, kernel_size=3, padding="same", use_bias=False)(x)
    x = batch_norm(scale=False, center=True)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(filters=24, kernel_size=6, use_bias=False, strides=2)(x)
    x = batch_norm(scale=False, center=True)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(filters=32, kernel_size=6, padding="same", strides=2, use_bias=False)(x)
    x = batch_norm(scale=False, center=True)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(256, activation="relu")(x)
    x = keras.layers.Dropout(0.5)(x)
    outputs = keras.layers.Dense(NUM_CLASSES)(x)
    return keras.Model(inputs, outputs)


def compiled_batchnorm_convnet() -> keras.Model:
    """The guide's model, optimizer and loss (Adam 1e-3, cross-entropy on logits), no metrics:
    the hand-written loops compute none either."""
    model = batchnorm_convnet()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(True))
    return model
