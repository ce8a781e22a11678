"""N replicas train exactly like single-device Keras, padded last batch included."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from jax_dp_helpers import GLOBAL_BATCH, assert_history_close, assert_weights_close, dense_bn_model

import jax_dp

pytestmark = pytest.mark.timeout(240)
EPOCHS = 2


@pytest.fixture(scope="module", params=["sgd", "adam"])
def reference(request, data):
    """Single-device ``model.fit`` from known initial weights, with its evaluate and predict."""
    x, y, x_val, y_val = data
    model = dense_bn_model(request.param)
    initial = model.get_weights()
    history = model.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, validation_data=(x_val, y_val), verbose=0
    )
    evaluation = model.evaluate(x_val, y_val, batch_size=GLOBAL_BATCH, return_dict=True, verbose=0)
    predictions = model.predict(x_val, batch_size=GLOBAL_BATCH, verbose=0)
    return request.param, initial, model, history.history, evaluation, predictions


@pytest.mark.parametrize("num_replicas", [1, 2, 4])
def test_fit_evaluate_predict_match_single_device_keras(reference, data, num_replicas):
    optimizer, initial, expected_model, expected_history, expected_eval, expected_pred = reference
    x, y, x_val, y_val = data
    model = dense_bn_model(optimizer, seed=7)  # different init, overwritten: weights come from the reference
    model.set_weights(initial)
    trainer = jax_dp.Trainer(num_replicas)

    history = trainer.fit(
        model,
        x,
        y,
        global_batch_size=GLOBAL_BATCH,
        epochs=EPOCHS,
        shuffle=False,
        validation_data=(x_val, y_val),
        verbose=0,
    )

    assert trainer.num_replicas == num_replicas
    assert history.model is model
    assert_history_close(expected_history, history.history)
    assert_weights_close(expected_model, model)
    evaluation = trainer.evaluate(model, x_val, y_val, global_batch_size=GLOBAL_BATCH, return_dict=True, verbose=0)
    assert evaluation == pytest.approx(expected_eval, abs=1e-5, rel=1e-5)
    predictions = trainer.predict(model, x_val, global_batch_size=GLOBAL_BATCH, verbose=0)
    assert predictions.shape == (len(x_val), 1)
    np.testing.assert_allclose(predictions, expected_pred, atol=1e-5)


def test_sample_weight_and_shuffled_order_match_keras_on_the_same_order(data):
    x, y, _, _ = data
    sample_weight = np.random.default_rng(3).uniform(0.1, 2.0, size=len(x)).astype("float32")
    order = jax_dp_order = np.asarray(__import__("dp_core").epoch_order(len(x), seed=5, epoch=0))
    reference = dense_bn_model("sgd")
    initial = reference.get_weights()
    expected = reference.fit(
        x[order], y[order], sample_weight=sample_weight[order], batch_size=GLOBAL_BATCH, shuffle=False, verbose=0
    )
    model = dense_bn_model("sgd")
    model.set_weights(initial)

    history = jax_dp.Trainer(2).fit(
        model, x, y, sample_weight=sample_weight, global_batch_size=GLOBAL_BATCH, shuffle=True, seed=5, verbose=0
    )

    assert jax_dp_order.tolist() != list(range(len(x)))  # really shuffled
    assert_history_close(expected.history, history.history)
    assert_weights_close(reference, model)


def test_uneven_last_batch_trains_where_keras_data_parallel_would_not_divide(data):
    # 99 rows on 4 replicas: the last global batch has 3 real rows, fewer than replicas.
    x, y, _, _ = data
    model = dense_bn_model("sgd")
    history = jax_dp.Trainer(4).fit(model, x, y, global_batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert history.history["loss"][0] > 0


def test_model_factory_is_called_and_trained(data):
    x, y, _, _ = data
    history = jax_dp.Trainer(2).fit(lambda: dense_bn_model("sgd"), x, y, global_batch_size=GLOBAL_BATCH, verbose=0)
    assert isinstance(history.model, keras.Model)
    assert len(history.history["loss"]) == 1
