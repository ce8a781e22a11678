"""``estimate_memory``: a replica's bytes under each ``shard=`` mode, counted by hand for a small model."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from dp_core.keras import estimate_memory

# Dense(5 -> 8, no bias) 40, BatchNormalization(8) 16 trainable + 16 moving statistics, Dense(8 -> 3) 27
TRAINABLE, FROZEN, LARGEST_LAYER = 83 * 4, 16 * 4, 40 * 4


def _model(optimizer: str = "adam") -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.Activation("relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    return model


def _data(rows: int = 8) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((rows, 5), "float32"), np.zeros(rows, "int64")


def test_each_shard_mode_splits_what_zero_splits_and_full_gathers_the_largest_layer():
    model = _model()
    x, y = _data()
    estimate = estimate_memory(
        model, x, y, global_batch_size=32, num_replicas=2, shard="gradients", device="cpu", device_memory=10**6
    )
    slots = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.optimizer.variables)
    assert slots - 2 * TRAINABLE <= 16  # Adam: two slots a weight, and its step counter (and rate)
    activations = 16 * (5 + 8 + 8 + 8 + 3) * 4  # 16 rows a replica: the input and each layer's output, float32
    assert [tuple(mode) for mode in estimate.modes] == [
        (None, TRAINABLE + FROZEN, TRAINABLE, slots, activations, 0),
        ("optimizer", TRAINABLE + FROZEN, TRAINABLE, slots // 2, activations, 0),
        ("gradients", TRAINABLE + FROZEN, TRAINABLE // 2, slots // 2, activations, 0),
        ("full", TRAINABLE // 2 + FROZEN, TRAINABLE // 2, slots // 2, activations, 2 * LARGEST_LAYER),
    ]
    assert estimate.per_replica_batch_size == 16 and estimate.fits
    assert estimate.for_shard("gradients").total == TRAINABLE + FROZEN + TRAINABLE // 2 + slots // 2 + activations
    table = str(estimate).splitlines()
    assert table[0] == "Memory per replica (2 replicas, 16 rows each), device: cpu, 976.6 KB"
    assert table[4].startswith("'gradients' (this)") and table[-1] == "shard='gradients': fits"


def test_a_model_larger_than_the_device_does_not_fit_and_sgd_holds_no_slots():
    x, y = _data()
    estimate = estimate_memory(
        _model("sgd"), x, y, global_batch_size=8, num_replicas=1, shard=None, device="gpu", device_memory=1000
    )
    assert estimate.for_shard(None).optimizer_state <= 16  # plain SGD: its step counter only
    assert estimate.for_shard(None).total > 1000 and estimate.fits is False
    assert str(estimate).splitlines()[-1] == "shard=None: does NOT fit"


class Subclassed(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)


def test_a_subclassed_model_says_its_activations_are_not_estimated():
    model = Subclassed()
    model.compile(optimizer="sgd", loss="mse")
    x = np.zeros((4, 5), "float32")
    estimate = estimate_memory(
        model, x, np.zeros((4, 3), "float32"), global_batch_size=4, num_replicas=2, shard=None, device="cpu",
        device_memory=None,
    )  # fmt: skip
    assert estimate.for_shard(None).activations is None and estimate.for_shard(None).weights == 18 * 4
    assert str(estimate).endswith(
        "(activations not estimated: a subclassed model's layers have no outputs before a call)"
    )
    assert estimate.device_memory is not None and estimate.device_memory > 0  # the host's, over 2 replicas


def test_an_unbuilt_model_without_x_is_refused_with_what_to_pass():
    unbuilt = keras.Sequential([keras.layers.Dense(3)])  # no keras.Input: built at its first call
    unbuilt.compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match="estimate needs x \\(and y\\) to build model .* or build the model first"):
        estimate_memory(unbuilt, global_batch_size=8, num_replicas=2, shard=None, device="cpu", device_memory=None)


def test_a_built_model_needs_no_x_and_is_counted_as_with_it():
    """``trainer.estimate(model, global_batch_size=...)``: a model made with keras.Input is built; its
    optimizer is built here on its variables, as fit's first step builds it (Adam's slots counted)."""

    def estimate(model: keras.Model, *data: np.ndarray):
        return estimate_memory(
            model, *data, global_batch_size=32, num_replicas=2, shard=None, device="cpu", device_memory=10**6
        )

    without_x = estimate(_model())
    assert without_x == estimate(_model(), *_data())
    assert without_x.for_shard(None).optimizer_state >= 2 * TRAINABLE


def test_a_global_batch_that_does_not_divide_is_counted_padded_as_fit_pads_it():
    """33 rows on 2 replicas: fit pads each step to 34, 17 rows a replica (refused before this)."""
    estimate = estimate_memory(
        _model(), *_data(), global_batch_size=33, num_replicas=2, shard=None, device="cpu", device_memory=None
    )
    assert estimate.per_replica_batch_size == 17
    assert estimate.for_shard(None).activations == 17 * (5 + 8 + 8 + 8 + 3) * 4
