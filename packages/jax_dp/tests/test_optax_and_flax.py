"""The optax path and a flax model (keras.layers.FlaxLayer) through the same Trainer."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import keras
import optax
import pytest
from jax_dp_helpers import GLOBAL_BATCH, assert_history_close, assert_weights_close, dense_bn_model

import jax_dp
from dp_core import linear_scaling

pytestmark = pytest.mark.timeout(240)


def test_optax_momentum_matches_keras_momentum(data):
    # optax.sgd(lr, momentum) and keras SGD(lr, momentum) are the same update for a constant rate.
    x, y, _, _ = data
    reference = dense_bn_model("sgd")
    reference.optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    reference.compile(optimizer=reference.optimizer, loss="mse", metrics=["mae"])
    initial = reference.get_weights()
    expected = reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    model = dense_bn_model("sgd")
    model.set_weights(initial)

    history = jax_dp.Trainer(2, optimizer=optax.sgd(0.05, momentum=0.9)).fit(
        model, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0
    )

    assert_history_close(expected.history, history.history)
    assert_weights_close(reference, model)


def test_optax_lr_scaling_and_warmup_match_the_keras_optimizer(data):
    x, y, _, _ = data
    policy = {"lr_scaling": linear_scaling(16), "warmup_steps": 3}
    keras_model = dense_bn_model("sgd")  # SGD(0.1): scaled to 0.2, ramped over 3 steps
    initial = keras_model.get_weights()
    expected = jax_dp.Trainer(2).fit(
        keras_model, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0, **policy
    )
    optax_model = dense_bn_model("sgd")
    optax_model.set_weights(initial)

    history = jax_dp.Trainer(2, optimizer=optax.sgd(0.1)).fit(
        optax_model, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0, **policy
    )

    assert_history_close(expected.history, history.history)
    assert_weights_close(keras_model, optax_model)
    untouched = dense_bn_model("sgd")
    untouched.set_weights(initial)
    jax_dp.Trainer(2, optimizer=optax.sgd(0.1)).fit(
        untouched, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0
    )
    assert abs(untouched.get_weights()[-1] - optax_model.get_weights()[-1]).max() > 1e-4  # the policy did act


class FlaxMLP(nn.Module):
    @nn.compact
    def __call__(self, inputs):
        return nn.Dense(1)(nn.relu(nn.Dense(8)(inputs)))


def flax_model() -> keras.Model:
    module = FlaxMLP()
    # Variables from module.init: Keras 3.15's FlaxLayer would otherwise need TensorFlow to build.
    variables = module.init(jax.random.key(2), jnp.ones((1, 5)))
    model = keras.Sequential([keras.Input((5,)), keras.layers.FlaxLayer(module, variables=variables)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model


def test_flax_module_in_a_flax_layer_matches_single_device_keras(data):
    x, y, _, _ = data
    reference = flax_model()
    initial = reference.get_weights()
    expected = reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    model = flax_model()
    model.set_weights(initial)

    history = jax_dp.Trainer(4).fit(model, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)

    assert_history_close(expected.history, history.history)
    assert_weights_close(reference, model)
