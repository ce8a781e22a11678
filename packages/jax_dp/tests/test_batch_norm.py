"""Padded rows stay out of BatchNormalization's moments, globally or per replica."""

from __future__ import annotations

import jax.numpy as jnp
import keras
import numpy as np
import pytest

from jax_dp._step.padding import padding_aware

pytestmark = pytest.mark.timeout(60)


def batch_norm_model() -> tuple[keras.Model, keras.layers.BatchNormalization]:
    layer = keras.layers.BatchNormalization(momentum=0.5, epsilon=1e-3)
    model = keras.Sequential([keras.Input((3,)), layer])
    return model, layer


def normalized(rows: np.ndarray, epsilon: float = 1e-3) -> np.ndarray:
    return (rows - rows.mean(0)) / np.sqrt(rows.var(0) + epsilon)


def test_global_moments_ignore_padded_rows():
    rows = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    rows[5:] = 1e6  # padding: huge values that would wreck the moments if counted
    mask = jnp.asarray([1, 1, 1, 1, 1, 0, 0, 0], jnp.float32)
    model, layer = batch_norm_model()

    with padding_aware(model, mask):
        outputs = np.asarray(layer(rows, training=True))

    np.testing.assert_allclose(outputs[:5], normalized(rows[:5]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(layer.moving_mean.value), 0.5 * rows[:5].mean(0), atol=1e-5)
    assert "_moments" not in vars(layer)  # the override is gone after the block


def test_replica_moments_normalize_each_replica_on_its_own():
    rows = np.random.default_rng(1).normal(size=(8, 3)).astype("float32")
    rows[4:] += 5.0  # replica 1's rows sit elsewhere: global and per-replica moments differ
    rows[7] = 1e6  # one padded row on replica 1
    mask = jnp.asarray([1, 1, 1, 1, 1, 1, 1, 0], jnp.float32)
    model, layer = batch_norm_model()

    with padding_aware(model, mask, batch_norm="per_replica", num_replicas=2):
        outputs = np.asarray(layer(rows, training=True))

    np.testing.assert_allclose(outputs[:4], normalized(rows[:4]), atol=1e-5)
    np.testing.assert_allclose(outputs[4:7], normalized(rows[4:7]), atol=1e-5)
    replica_mean = (rows[:4].mean(0) + rows[4:7].mean(0)) / 2
    np.testing.assert_allclose(np.asarray(layer.moving_mean.value), 0.5 * replica_mean, atol=1e-5)
    assert "call" not in vars(layer)


def test_batch_norm_moments_are_masked_only_in_padded_steps():
    # an epoch without a padded batch keeps Keras's own moments: masking would only read every
    # activation twice more (the compiled step matched keras.distribution's once it did not)
    from dp_core.keras import internals

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization()])
    layer = model.layers[0]
    keras_moments = internals.batch_norm_moments(layer)
    mask = jnp.ones((8,))
    with padding_aware(model, mask, padded=False):
        assert internals.batch_norm_moments(layer) == keras_moments
    with padding_aware(model, mask, padded=True):
        assert internals.batch_norm_moments(layer) != keras_moments
    assert internals.batch_norm_moments(layer) == keras_moments
