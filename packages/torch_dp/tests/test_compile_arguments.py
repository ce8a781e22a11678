"""What ``compile()`` was given reaches the worker replicas as given (issue 43, items 7 and 13)."""

import threading

import keras
import numpy as np
import pytest
import torch_dp_testing as testing

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

FIT = dict(batch_size=32, epochs=2, shuffle=False, verbose=0)


def unscaled_mixed_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3, activation="softmax", dtype="float32"),
        ]
    )
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", auto_scale_loss=False)
    return model


def test_auto_scale_loss_false_under_mixed_float16_trains_as_model_fit(two_replicas):
    """``auto_scale_loss=False``: Keras keeps the plain optimizer under ``mixed_float16``, and so does every
    worker (it rebuilt a LossScaleOptimizer, whose extra variables failed the call)."""
    x, y = testing.data()
    caller_policy = keras.config.dtype_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        expected, model = unscaled_mixed_model(), unscaled_mixed_model()
        want = expected.fit(x, y, **FIT).history
        got = two_replicas.fit(model, x, y, **FIT).history
    finally:
        keras.mixed_precision.set_global_policy(caller_policy)
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-3, atol=1e-3)
    for variable, wanted, trained in zip(expected.weights, expected.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(trained, wanted, rtol=1e-2, atol=1e-3, err_msg=variable.path)


def locked_loss_model() -> keras.Model:
    """Compiled with a loss closing over a lock, which cannot be pickled."""
    lock = threading.Lock()

    def locked_squared_error(y_true, y_pred):
        with lock:
            return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1), loss=locked_squared_error)
    return model


def test_a_loss_that_cannot_travel_is_named_and_predict_does_without_it(two_replicas):
    """A loss closing over a lock: fit and evaluate say it is compile()'s loss that cannot reach the workers,
    before any step; predict, which needs no loss, works and equals model.predict."""
    x, _ = testing.data()
    y = x[:, :2].copy()
    model = locked_loss_model()
    for call in (
        lambda: two_replicas.fit(model, x, y, batch_size=32, verbose=0),
        lambda: two_replicas.evaluate(model, x, y, verbose=0),
    ):
        with pytest.raises(TypeError) as raised:
            call()
        message = str(raised.value)
        assert "the loss 'locked_squared_error' (compile(loss=...))" in message
        assert "cannot pickle '_thread.lock' object" in message and "dataset" not in message
    predicted = two_replicas.predict(model, x, batch_size=32, verbose=0)
    np.testing.assert_allclose(predicted, model.predict(x, batch_size=32, verbose=0), rtol=1e-6, atol=1e-6)
