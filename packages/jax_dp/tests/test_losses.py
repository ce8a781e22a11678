"""Losses on outputs of any shape, Keras masks, batch-summing losses and regularizers: jax_dp
equals single-device Keras on the same global batches, the padded last one included
(99 rows, global batch 32: its last batch has 3 real rows)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from jax_dp_helpers import NUM_SAMPLES, assert_same_run, keras_run, trainer_run

import jax_dp

pytestmark = pytest.mark.timeout(240)
STEPS, CLASSES = 5, 3  # timesteps (and pixels per side) and classes of the per-position models


def _data(seed: int = 0):
    return np.random.default_rng(seed)


def _compiled(layers, loss, **compile_kwargs) -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss, **compile_kwargs)
    return model


def sequence_tagger() -> keras.Model:
    """(N, T, 3) -> a class per timestep (N, T, C): sequence labelling."""
    layers = [keras.Input((STEPS, 3)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(CLASSES)]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return _compiled(layers, loss, metrics=["accuracy"], weighted_metrics=["accuracy"])


def segmenter() -> keras.Model:
    """(N, H, W, 2) -> a class per pixel (N, H, W, C): segmentation."""
    layers = [
        keras.Input((STEPS, STEPS, 2)),
        keras.layers.Conv2D(4, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(CLASSES, 1, activation="softmax"),
    ]
    return _compiled(layers, "sparse_categorical_crossentropy", metrics=["accuracy"], weighted_metrics=["accuracy"])


@pytest.mark.parametrize(
    ("kind", "weighted"),
    [("sequence", False), ("segmentation", False), ("segmentation", True)],
    ids=["sequence", "segmentation", "segmentation-sample_weight"],
)
def test_per_timestep_and_per_pixel_outputs_equal_keras(kind, weighted):
    draw = _data()
    if kind == "sequence":
        build, x = sequence_tagger, draw.normal(size=(NUM_SAMPLES, STEPS, 3)).astype("float32")
    else:
        build, x = segmenter, draw.normal(size=(NUM_SAMPLES, STEPS, STEPS, 2)).astype("float32")
    y = draw.integers(0, CLASSES, size=x.shape[:-1])
    # Keras takes a sample weight per position for these outputs (a (N,) one does not broadcast).
    sample_weight = draw.uniform(0.1, 2.0, size=y.shape).astype("float32") if weighted else None

    expected, initial = keras_run(build, x, y, sample_weight)
    actual = trainer_run(build, initial, x, y, sample_weight)

    assert_same_run(expected, actual)


def token_sequences(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token ids padded with 0 after a random length, and a class per timestep."""
    draw = _data(seed)
    tokens = draw.integers(1, 10, size=(NUM_SAMPLES, STEPS))
    tokens[np.arange(STEPS)[None, :] >= draw.integers(1, STEPS + 1, size=(NUM_SAMPLES, 1))] = 0
    return tokens, draw.integers(0, CLASSES, size=(NUM_SAMPLES, STEPS))


def masked_tagger(recurrent: bool) -> keras.Model:
    """Embedding(mask_zero=True) (+ SimpleRNN) + Dense per timestep: the loss averages over valid timesteps."""
    layers = [keras.Input((STEPS,), dtype="int32"), keras.layers.Embedding(10, 4, mask_zero=True)]
    layers += [keras.layers.SimpleRNN(5, return_sequences=True)] if recurrent else []
    layers += [keras.layers.Dense(CLASSES, activation="softmax")]
    return _compiled(layers, "sparse_categorical_crossentropy", metrics=["accuracy"])


def masking_tagger() -> keras.Model:
    """Masking (zeros) + Dense per timestep."""
    layers = [
        keras.Input((STEPS, 2)),
        keras.layers.Masking(0.0),
        keras.layers.Dense(CLASSES, activation="softmax"),
    ]
    return _compiled(layers, "sparse_categorical_crossentropy", metrics=["accuracy"])


@pytest.mark.parametrize(
    ("recurrent", "num_replicas", "epochs"), [(True, 2, 1), (False, 4, 2)], ids=["rnn-2", "dense-4"]
)
def test_keras_masked_loss_counts_only_the_real_rows_valid_positions(recurrent, num_replicas, epochs):
    # Padded rows repeat real rows, mask included: unless they count as invalid, the last batch's
    # loss divides by too many valid positions. A second epoch pads with other rows.
    tokens, y = token_sequences()

    def build():
        return masked_tagger(recurrent)

    expected, initial = keras_run(build, tokens, y, epochs=epochs)
    actual = trainer_run(build, initial, tokens, y, num_replicas=num_replicas, epochs=epochs)
    assert_same_run(expected, actual)


def test_masking_layer_with_sample_weight_equals_keras():
    tokens, y = token_sequences(1)
    x = np.stack([tokens, tokens[:, ::-1]], axis=-1).astype("float32") * (tokens > 0)[..., None]
    sample_weight = _data(2).uniform(0.1, 2.0, size=y.shape).astype("float32")
    expected, initial = keras_run(masking_tagger, x, y, sample_weight)
    actual = trainer_run(masking_tagger, initial, x, y, sample_weight)
    assert_same_run(expected, actual)


def binary_segmenter(loss) -> keras.Model:
    layers = [keras.Input((STEPS, STEPS, 2)), keras.layers.Conv2D(1, 3, padding="same", activation="sigmoid")]
    return _compiled(layers, loss, metrics=["accuracy"])


@pytest.mark.parametrize(
    ("loss", "weighted"),
    [(keras.losses.Dice, True), (keras.losses.Tversky, False)],
    ids=["dice-sample_weight", "tversky"],
)
def test_losses_summing_over_the_batch_leave_padded_rows_out(loss, weighted):
    # Dice() and Tversky() (axis=None) give one value for the whole batch, not one per row.
    draw = _data(3)
    x = draw.normal(size=(NUM_SAMPLES, STEPS, STEPS, 2)).astype("float32")
    y = (draw.uniform(size=(NUM_SAMPLES, STEPS, STEPS, 1)) > 0.5).astype("float32")
    sample_weight = draw.uniform(0.1, 2.0, size=NUM_SAMPLES).astype("float32") if weighted else None

    def build():
        return binary_segmenter(loss())

    expected, initial = keras_run(build, x, y, sample_weight)
    actual = trainer_run(build, initial, x, y, sample_weight)

    assert not np.allclose(initial[0], actual.model.get_weights()[0])  # it trained
    assert_same_run(expected, actual)


def batch_mean_loss(y_true, y_pred):
    """A user loss that reduces over the batch axis too: one value per batch."""
    return keras.ops.mean(keras.ops.square(y_true - y_pred))


def test_a_loss_reducing_over_the_batch_is_refused_before_training_when_the_last_batch_is_padded(data):
    x, y, _, _ = data

    def build():
        return _compiled([keras.Input((5,)), keras.layers.Dense(1)], batch_mean_loss)

    model = build()
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"'batch_mean_loss'.*reduces over the batch axis.*shape \(\)"):
        jax_dp.Trainer(2).fit(model, x, y, global_batch_size=32, verbose=0)
    for unchanged, initial in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(unchanged, initial)
    # Without a padded batch there is nothing to leave out: it trains as in Keras.
    expected, initial = keras_run(build, x[:96], y[:96])
    assert_same_run(expected, trainer_run(build, initial, x[:96], y[:96]))


def test_activity_regularizer_counts_only_real_rows(data):
    x, y, _, _ = data

    def build():
        regularized = keras.layers.Dense(4, activation="tanh", activity_regularizer=keras.regularizers.L2(0.1))
        return _compiled([keras.Input((5,)), regularized, keras.layers.Dense(1)], "mse", metrics=["mae"])

    expected, initial = keras_run(build, x, y)
    assert_same_run(expected, trainer_run(build, initial, x, y))


class KernelPenalty(keras.layers.Layer):
    """Dense whose ``call`` adds a loss on its kernel alone: the same whatever the batch."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 2), initializer="glorot_uniform")

    def call(self, inputs):
        self.add_loss(0.1 * keras.ops.sum(keras.ops.square(self.kernel)))
        return inputs @ self.kernel


def test_add_loss_terms_count_once_per_global_batch(data):
    x, y, _, _ = data

    def build():
        return _compiled([keras.Input((5,)), KernelPenalty(), keras.layers.Dense(1)], "mse")

    expected, initial = keras_run(build, x, y)
    assert_same_run(expected, trainer_run(build, initial, x, y, num_replicas=4))
