"""Where ``fit``/``evaluate``/``predict`` follow Keras's own loops (issue 43): each against plain
``model.fit``/``evaluate``/``predict`` on one device, same seed and data."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from jax_dp_helpers import GLOBAL_BATCH, assert_history_close

import jax_dp

pytestmark = pytest.mark.timeout(240)


class NoisyAtInference(keras.layers.Layer):
    """Draws dropout noise at inference too, from its own seed generator."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_gen = keras.random.SeedGenerator(7)

    def call(self, inputs):
        return keras.random.dropout(inputs, 0.5, seed=self.seed_gen)


def _noisy_model() -> keras.Model:
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3), NoisyAtInference()])
    model.compile(optimizer="sgd", loss="mse")
    return model


def _seed_state(model: keras.Model) -> np.ndarray:
    return keras.ops.convert_to_numpy(model.layers[-1].seed_gen.state.value)


@pytest.mark.parametrize("num_replicas", [1, 4])
def test_predict_advances_a_seed_generator_as_model_predict_does(data, num_replicas):
    x = data[0][:64]  # two whole global batches
    expected_model, model = _noisy_model(), _noisy_model()
    expected = [expected_model.predict(x, batch_size=GLOBAL_BATCH, verbose=0) for _ in range(2)]
    trainer = jax_dp.Trainer(num_replicas)
    got = [trainer.predict(model, x, global_batch_size=GLOBAL_BATCH, verbose=0) for _ in range(2)]

    assert not np.array_equal(got[0], got[1])  # the noise differs from call to call
    np.testing.assert_array_equal(_seed_state(model), _seed_state(expected_model))
    # one global batch's noise is drawn whole (jax's partitionable threefry): the same bits on any number of devices
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_allclose(have, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_replicas", [1, 4])
def test_evaluate_advances_a_seed_generator_as_model_evaluate_does(data, num_replicas):
    x, y = data[0][:64], data[1][:64, :1].repeat(3, axis=1)
    expected_model, model = _noisy_model(), _noisy_model()
    expected = [expected_model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0) for _ in range(2)]
    trainer = jax_dp.Trainer(num_replicas)
    got = [trainer.evaluate(model, x, y, global_batch_size=GLOBAL_BATCH, verbose=0) for _ in range(2)]

    assert got[0] != got[1]
    np.testing.assert_array_equal(_seed_state(model), _seed_state(expected_model))
    np.testing.assert_allclose(got, expected, rtol=1e-5)


class KeepsItsState(keras.metrics.MeanSquaredError):
    """A metric whose own ``reset_state`` keeps what it has: Keras calls it at each epoch's start."""

    def reset_state(self):
        pass


def _kept_metric_model() -> keras.Model:
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=[KeepsItsState(name="kept")])
    return model


@pytest.mark.parametrize("validation", [False, True])
def test_a_metrics_own_reset_state_is_what_resets_it_between_epochs(data, validation):
    x, y, x_val, y_val = data
    val = {"validation_data": (x_val, y_val)} if validation else {}
    expected = _kept_metric_model().fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False, verbose=0, **val)
    model = _kept_metric_model()
    history = jax_dp.Trainer(2).fit(
        model, x, y, global_batch_size=GLOBAL_BATCH, epochs=3, shuffle=False, verbose=0, **val
    )

    assert_history_close(expected.history, history.history)
    kept = np.asarray(history.history["kept"])
    assert not np.allclose(kept, history.history["loss"])  # it carried over: not each epoch's own mean


class BatchHooks(keras.callbacks.Callback):
    """Records every test and predict batch hook with its batch index."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def on_test_batch_begin(self, batch, logs=None):
        self.calls.append(("test_begin", batch))

    def on_test_batch_end(self, batch, logs=None):
        self.calls.append(("test_end", batch))

    def on_predict_batch_begin(self, batch, logs=None):
        self.calls.append(("predict_begin", batch))

    def on_predict_batch_end(self, batch, logs=None):
        self.calls.append(("predict_end", batch))


class OwnPredictStep(keras.Sequential):
    def predict_step(self, state, data):
        return super().predict_step(state, data)


@pytest.mark.parametrize("own_predict_step", [False, True])
def test_test_and_predict_batch_begin_hooks_run_before_each_batch_as_in_keras(data, own_predict_step):
    x, y, _, _ = data  # 99 rows: 4 batches, the last short
    calls = {}
    for name in ("keras", "jax_dp"):
        keras.utils.set_random_seed(6)
        model = (OwnPredictStep if own_predict_step else keras.Sequential)([keras.Input((5,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        hooks = BatchHooks()
        if name == "keras":
            model.evaluate(x, y, batch_size=GLOBAL_BATCH, callbacks=[hooks], verbose=0)
            model.predict(x, batch_size=GLOBAL_BATCH, callbacks=[hooks], verbose=0)
        else:
            trainer = jax_dp.Trainer(2)
            trainer.evaluate(model, x, y, global_batch_size=GLOBAL_BATCH, callbacks=[hooks], verbose=0)
            trainer.predict(model, x, global_batch_size=GLOBAL_BATCH, callbacks=[hooks], verbose=0)
        calls[name] = hooks.calls

    assert calls["jax_dp"] == calls["keras"]
    assert calls["keras"][:2] == [("test_begin", 0), ("test_end", 0)] and len(calls["keras"]) == 16


class StopsAfter(keras.callbacks.Callback):
    """Stops the evaluation and the prediction at the end of batch ``batch``."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch = batch

    def on_test_batch_end(self, batch, logs=None):
        self.model.stop_evaluating = batch == self.batch

    def on_predict_batch_end(self, batch, logs=None):
        self.model.stop_predicting = batch == self.batch


class Counted:
    """A finite generator of global batches that counts the batches read."""

    def __init__(self, x: np.ndarray, y: np.ndarray | None = None) -> None:
        self.x, self.y, self.read = x, y, 0

    def __iter__(self):
        for start in range(0, len(self.x), GLOBAL_BATCH):
            self.read += 1
            rows = slice(start, start + GLOBAL_BATCH)
            yield (self.x[rows],) if self.y is None else (self.x[rows], self.y[rows])


def test_a_callback_stopping_evaluation_and_prediction_ends_them_after_that_batch(data):
    x, y = (np.concatenate([part] * 2) for part in data[:2])  # 198 rows: 7 batches
    runs = {}
    for name in ("keras", "jax_dp"):
        keras.utils.set_random_seed(6)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        evaluated, predicted = Counted(x, y), Counted(x)
        if name == "keras":
            logs = model.evaluate(iter(evaluated), callbacks=[StopsAfter(1)], verbose=0, return_dict=True)
            outputs = model.predict(iter(predicted), callbacks=[StopsAfter(1)], verbose=0)
        else:
            trainer = jax_dp.Trainer(4)
            logs = trainer.evaluate(model, iter(evaluated), callbacks=[StopsAfter(1)], verbose=0, return_dict=True)
            outputs = trainer.predict(model, iter(predicted), callbacks=[StopsAfter(1)], verbose=0)
        runs[name] = logs, outputs, evaluated.read, predicted.read

    (expected_logs, expected_outputs, *expected_read), (logs, outputs, *read) = runs["keras"], runs["jax_dp"]
    assert read == expected_read
    assert outputs.shape == expected_outputs.shape == (2 * GLOBAL_BATCH, 1)
    np.testing.assert_allclose(outputs, expected_outputs, rtol=1e-5, atol=1e-6)
    assert_history_close(expected_logs, logs)
