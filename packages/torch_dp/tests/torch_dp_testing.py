"""Models, data and callbacks shared by the tests and importable by worker processes."""

from __future__ import annotations

import os

import keras
import numpy as np
import torch.distributed as dist

NUM_SAMPLES = 99  # not a multiple of the global batch: the last batch is padded
GLOBAL_BATCH_SIZE = 32


def data(num_samples: int = NUM_SAMPLES, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_samples, 5)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 1).astype("int64")
    return x, y


def dense_batchnorm_model(optimizer: str = "sgd", seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            # no bias before BN: its gradient is pure rounding noise, which Adam would amplify
            keras.layers.Dense(8, use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.Activation("relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    chosen = keras.optimizers.SGD(0.1, momentum=0.9) if optimizer == "sgd" else keras.optimizers.Adam(0.01)
    model.compile(optimizer=chosen, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def halving(epoch: int, learning_rate: float) -> float:
    """A LearningRateScheduler schedule: 0.1, 0.05, 0.025, ..."""
    return 0.1 * 0.5**epoch


class EpochLines(keras.callbacks.Callback):
    """Writes one line per epoch end ('epoch pid loss') to ``path``."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def on_epoch_end(self, epoch, logs=None):
        with open(self.path, "a") as f:
            f.write(f"{epoch} {os.getpid()} {logs['loss']!r}\n")


class StopAtBatch(keras.callbacks.Callback):
    """Asks to stop at the end of batch ``batch`` of epoch ``epoch`` (a batch-level decision)."""

    def __init__(self, batch: int, epoch: int = 0) -> None:
        super().__init__()
        self.batch, self.epoch, self.current_epoch = batch, epoch, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.current_epoch, batch) == (self.epoch, self.batch):
            self.model.stop_training = True


class FailingFactory:
    """Builds the model, but raises on replica ``failing_rank``; records each worker's pid."""

    def __init__(self, pid_dir: str, failing_rank: int = 1) -> None:
        self.pid_dir = pid_dir
        self.failing_rank = failing_rank

    def __call__(self) -> keras.Model:
        if dist.is_initialized():
            with open(os.path.join(self.pid_dir, f"pid_{dist.get_rank()}"), "w") as f:
                f.write(str(os.getpid()))
            if dist.get_rank() == self.failing_rank:
                raise RuntimeError("boom on purpose in the model factory")
        return dense_batchnorm_model()
