"""What ``compile()`` was given reaches the worker replicas as given (issue 43, items 7 and 13)."""

import threading

import keras
import numpy as np
import pytest
import torch_dp_testing as testing

from torch_dp._processes.transfer import ship_model

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


def objects_keras_cannot_rebuild() -> keras.Model:
    """A model with a tuple of outputs (Keras's format gives back a list), compiled with what Keras's compile
    config cannot rebuild: two loss closures of one factory (one name, two scales), each closing over a layer
    of the model (a penalty on its kernel), and a metric class made here, whose ``__init__`` takes no name and
    whose ``reset_state`` keeps its states (Keras's trainer_test.py has one)."""

    class KeepsItsStates(keras.metrics.MeanSquaredError):
        def __init__(self):
            super().__init__(name="kept_mse")

        def reset_state(self):
            pass

    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(4, activation="tanh", name="hidden")
    features = hidden(inputs)
    model = keras.Model(inputs, (keras.layers.Dense(2, name="a")(features), keras.layers.Dense(1, name="b")(features)))

    def scaled(scale):
        def loss(y_true, y_pred):
            penalty = 0.01 * keras.ops.sum(keras.ops.square(hidden.kernel))
            return scale * keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1) + penalty

        return loss

    model.compile(keras.optimizers.SGD(0.1), loss=(scaled(1.0), scaled(3.0)), metrics=([KeepsItsStates()], []))
    return model


def test_compile_objects_keras_cannot_rebuild_train_as_model_fit(two_replicas):
    """What compile() got reaches the workers as itself: before, Keras's compile config refused the metric class
    and could not tell the two ``loss`` closures apart. Both models are evaluated on plain Keras first: the
    metric's states carry that over in Keras's History and in torch-dp's (rank 0's own; the workers' start at 0)."""
    x, _ = testing.data()
    y = (x[:, :2] * 0.5, x[:, 2:3] - x[:, 3:4])
    reference, model = objects_keras_cannot_rebuild(), objects_keras_cannot_rebuild()
    reference.evaluate(x, y, verbose=0)
    model.evaluate(x, y, verbose=0)
    want = reference.fit(x, y, **FIT).history
    got = two_replicas.fit(model, x, y, **FIT).history
    assert set(got) == set(want) and "a_kept_mse" in got
    for name, values in want.items():
        np.testing.assert_allclose(got[name], values, rtol=1e-5, atol=1e-6, err_msg=name)
    for variable, wanted, trained in zip(reference.weights, reference.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(trained, wanted, rtol=1e-5, atol=1e-6, err_msg=variable.path)
    evaluated = two_replicas.evaluate(model, x, y, batch_size=32, verbose=0)
    np.testing.assert_allclose(evaluated, reference.evaluate(x, y, batch_size=32, verbose=0), rtol=1e-5)
    predicted = two_replicas.predict(model, x, batch_size=32, verbose=0)
    assert isinstance(predicted, tuple)
    for mine, theirs in zip(predicted, reference.predict(x, batch_size=32, verbose=0), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


def test_a_model_whose_outputs_keras_restructures_goes_by_value(tmp_path):
    """Keras's format gives a tuple of outputs back as a list, which a loss structured for the tuple does not
    fit (Keras's model_test struct losses: ``[whole, (first, second)]``): such a model travels by value."""
    model = objects_keras_cannot_rebuild()
    model.save(tmp_path / "round_trip.keras")
    assert isinstance(model.output, tuple)
    assert isinstance(keras.saving.load_model(tmp_path / "round_trip.keras", compile=False).output, list)
    source = ship_model(model, model, str(tmp_path), trains=True)
    assert source.pickled is not None and source.keras_file is None
