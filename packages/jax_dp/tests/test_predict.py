"""``predict`` on models this process never trained: loaded, compiled only, never compiled, or
subclassed and built without its layers; each equals ``model.predict`` on all rows, in order."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from jax_dp_helpers import GLOBAL_BATCH, dense_bn_model

import jax_dp

pytestmark = pytest.mark.timeout(240)


@keras.saving.register_keras_serializable(package="jax_dp_tests")
class Tower(keras.Model):
    """A subclassed model: ``build(shape)`` leaves its layers unbuilt until a first call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(4, activation="relu")
        self.dropout = keras.layers.Dropout(0.5)
        self.out = keras.layers.Dense(2)

    def call(self, inputs, training=False):
        return self.out(self.dropout(self.hidden(inputs), training=training))


def _loaded(tmp_path, data) -> keras.Model:
    x, y, _, _ = data
    model = dense_bn_model("adam")
    model.fit(x, y, batch_size=GLOBAL_BATCH, verbose=0)  # BN statistics and weights away from their initial values
    model.save(tmp_path / "trained.keras")
    return keras.saving.load_model(tmp_path / "trained.keras")


def _compiled_only(tmp_path, data) -> keras.Model:
    return dense_bn_model("sgd")


def _never_compiled(tmp_path, data) -> keras.Model:
    keras.utils.set_random_seed(2)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(2)])


def _built_subclass(tmp_path, data) -> keras.Model:
    keras.utils.set_random_seed(3)
    model = Tower()
    model.build((None, 5))
    return model


@pytest.mark.parametrize("make", [_loaded, _compiled_only, _never_compiled, _built_subclass])
def test_predict_equals_keras_on_models_not_trained_here(make, tmp_path, data):
    x = data[0]
    model = make(tmp_path, data)

    predictions = jax_dp.Trainer(2).predict(model, x, global_batch_size=GLOBAL_BATCH, verbose=0)

    expected = model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
    assert predictions.shape == expected.shape == (len(x), expected.shape[1])
    np.testing.assert_allclose(predictions, expected, rtol=1e-5, atol=1e-6)


def test_predict_on_four_replicas_of_a_loaded_model(tmp_path, data):
    model = _loaded(tmp_path, data)
    x = data[0][:70]  # 3 global batches, the last with 6 real rows
    predictions = jax_dp.Trainer(4).predict(model, x, global_batch_size=GLOBAL_BATCH, verbose=0)
    np.testing.assert_allclose(predictions, model.predict(x, batch_size=GLOBAL_BATCH, verbose=0), rtol=1e-5, atol=1e-6)
