"""A model that overrides ``train_step``, ``test_step`` or ``predict_step`` (Keras's stateless jax
signatures) is trained, evaluated and predicted with its own step, giving what ``model.fit``,
``evaluate`` and ``predict`` give on one device, also on a last batch that does not divide over
the replicas.

Each step here computes something over the whole batch that a per-replica computation, or a
padded batch, would get wrong (the squared gap between the batch's mean prediction and mean
target, the spread of a batch's predictions, predictions centred on their batch mean), and
differs from Keras's default step, so running the default one instead fails too.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np
import optax
import pytest
from jax_dp_helpers import GLOBAL_BATCH, assert_history_close, assert_weights_close

import dp_core
import jax_dp

pytestmark = pytest.mark.timeout(300)
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))  # the parity matrix's GAN

from parity.gan import make_gan  # noqa: E402

TRACES: collections.Counter[str] = collections.Counter()


def rows(num_samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    draw = np.random.default_rng(seed)
    x = draw.normal(size=(num_samples, 5)).astype("float32")
    return x, (x @ draw.normal(size=(5, 1)) + 0.5).astype("float32")


def whole_batch_loss(y: Any, y_pred: Any) -> Any:
    """Mean squared error plus the squared gap of the batch means: not a mean of per-row terms."""
    return jnp.mean(jnp.square(y - y_pred)) + jnp.square(jnp.mean(y_pred) - jnp.mean(y))


class OwnTrainStep(keras.Model):
    """One Dense layer trained by its own step with the compiled optimizer; a Mean tracker of the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.loss_tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self) -> list[keras.metrics.Metric]:
        return [self.loss_tracker]

    def build(self, input_shape: Any) -> None:
        self.dense.build(input_shape)

    def call(self, x: Any) -> Any:
        return self.dense(x)

    def train_step(self, state: Any, data: Any) -> tuple[dict[str, Any], Any]:
        TRACES[f"train_{self.name}"] += 1  # once per trace: the body runs only while jax traces it
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data

        def loss_of(values: list[Any]) -> Any:
            y_pred, _ = self.stateless_call(values, non_trainable, x)
            return whole_batch_loss(y, y_pred)

        loss, grads = jax.value_and_grad(loss_of)(trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
        metrics_variables = self.loss_tracker.stateless_update_state(metrics_variables, loss)
        logs = {"loss": self.loss_tracker.stateless_result(metrics_variables)}
        return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)


def own_train_step_model() -> OwnTrainStep:
    keras.utils.set_random_seed(4)
    model = OwnTrainStep()
    model.build((None, 5))
    model.compile(optimizer=keras.optimizers.Adam(0.02))  # no loss: the step computes its own
    return model


def twins(build: Any) -> tuple[keras.Model, keras.Model]:
    """Two models with the same weights: one for plain Keras, one for the trainer."""
    expected, actual = build(), build()
    actual.set_weights(expected.get_weights())
    return expected, actual


@pytest.mark.parametrize(
    ("num_replicas", "num_samples"),
    [(2, 99), (4, 100)],
    ids=["last-3-rows-on-every-device", "last-4-rows-sharded"],
)
def test_own_train_step_trains_like_model_fit(num_replicas, num_samples):
    x, y = rows(num_samples)
    expected, actual = twins(own_train_step_model)
    want = expected.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)

    got = jax_dp.Trainer(num_replicas).fit(actual, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False)

    assert_weights_close(expected, actual)
    assert_history_close(want.history, got.history)
    assert all(isinstance(value, float) for value in got.history["loss"])
    assert int(actual.optimizer.iterations.numpy()) == 8  # the state the step returned came back
    np.testing.assert_allclose(actual.loss_tracker.result(), expected.loss_tracker.result(), rtol=1e-5)


def test_two_optimizer_gan_trains_like_model_fit():
    draw = np.random.default_rng(7)
    x = {
        "real": draw.normal(1.0, 0.5, size=(99, 4)).astype("float32"),
        "noise": draw.normal(size=(99, 2)).astype("float32"),
    }
    expected, actual = make_gan(), make_gan()
    want = expected.fit(x, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)

    got = jax_dp.Trainer(4).fit(actual, x, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)

    assert sorted(got.history) == ["d_loss", "g_loss"]
    assert_history_close(want.history, got.history)
    assert_weights_close(expected, actual)
    assert got.params == want.params


class OwnTestStep(keras.Model):
    """Keras's train step; its own test step scores the spread (max - min) of each batch's predictions
    and the mean absolute error, and logs the batch's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.spread = keras.metrics.Mean(name="spread")
        self.error = keras.metrics.Mean(name="error")

    def build(self, input_shape: Any) -> None:
        self.dense.build(input_shape)

    def call(self, x: Any) -> Any:
        return self.dense(x)

    def test_step(self, state: Any, data: Any) -> tuple[dict[str, Any], Any]:
        trainable, non_trainable, metrics_variables = state
        x, y = data
        y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x)
        states = list(metrics_variables)  # in model.metrics_variables' order: Mean "loss", MeanMetricWrapper "mae", ...
        spread = self.spread.stateless_update_state(
            [states[self.index(v)] for v in self.spread.variables], jnp.max(y_pred) - jnp.min(y_pred)
        )
        error = self.error.stateless_update_state(
            [states[self.index(v)] for v in self.error.variables], jnp.mean(jnp.abs(y - y_pred))
        )
        for variable, value in [
            *zip(self.spread.variables, spread, strict=True),
            *zip(self.error.variables, error, strict=True),
        ]:
            states[self.index(variable)] = value
        logs = {
            "spread": self.spread.stateless_result(spread),
            "error": self.error.stateless_result(error),
            "rows": jnp.asarray(x.shape[0], "float32"),  # not a metric: evaluate ends with the last batch's logs
        }
        return logs, (trainable, non_trainable, states)

    def index(self, variable: keras.Variable) -> int:
        return next(i for i, v in enumerate(self.metrics_variables) if v is variable)


def own_test_step_model() -> OwnTestStep:
    keras.utils.set_random_seed(6)
    model = OwnTestStep()
    model.build((None, 5))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model


def test_own_test_step_evaluates_and_validates_like_keras(data):
    x, y, x_val, y_val = data  # 99 and 37 rows: last batches of 3 and 5 rows on 2 replicas
    expected, actual = twins(own_test_step_model)
    trainer = jax_dp.Trainer(2)
    want = expected.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, validation_data=(x_val, y_val), verbose=0
    )

    got = trainer.fit(
        actual, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, validation_data=(x_val, y_val), verbose=0
    )

    assert {"val_spread", "val_error", "val_rows", "loss", "mae"} <= set(got.history)
    assert got.history["val_rows"] == [5.0, 5.0]
    assert_history_close(want.history, got.history)
    assert_weights_close(expected, actual)
    want_logs = expected.evaluate(x, y, batch_size=GLOBAL_BATCH, return_dict=True, verbose=0)
    got_logs = trainer.evaluate(actual, x, y, global_batch_size=GLOBAL_BATCH, return_dict=True, verbose=0)
    assert got_logs["rows"] == 3.0
    assert_history_close(want_logs, got_logs)
    np.testing.assert_allclose(actual.spread.result(), expected.spread.result(), rtol=1e-5)  # state written back
    in_order = trainer.evaluate(actual, x, y, global_batch_size=GLOBAL_BATCH, verbose=0)
    np.testing.assert_allclose(in_order, expected.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0), rtol=1e-5)
    seen = {"keras": RecordsSpread(), "trainer": RecordsSpread()}
    expected.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0, callbacks=[seen["keras"]])
    trainer.evaluate(actual, x, y, global_batch_size=GLOBAL_BATCH, verbose=0, callbacks=[seen["trainer"]])
    assert len(seen["trainer"].spreads) == 4
    np.testing.assert_allclose(seen["trainer"].spreads, seen["keras"].spreads, rtol=1e-5)


class RecordsSpread(keras.callbacks.Callback):
    """The spread tracker's running result after each batch, read through ``self.model`` (which
    writes the evaluation's current state into the model, as Keras's ``jax_state_sync`` does)."""

    def __init__(self) -> None:
        super().__init__()
        self.spreads: list[float] = []

    def on_test_batch_end(self, batch, logs=None):
        self.spreads.append(float(self.model.spread.result()))


class OwnPredictStep(keras.Model):
    """Its own predict step: each batch's predictions centred on the batch mean, and a
    non-trainable count of the batches predicted (the state the step returns is kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = keras.layers.Dense(2)
        self.batches = self.add_weight(shape=(), initializer="zeros", trainable=False, name="batches")

    def build(self, input_shape: Any) -> None:
        self.dense.build(input_shape)

    def call(self, x: Any) -> Any:
        return self.dense(x)

    def predict_step(self, state: Any, data: Any) -> tuple[Any, Any]:
        trainable, non_trainable = state
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x)
        counted = [
            value + 1 if variable is self.batches else value
            for variable, value in zip(self.non_trainable_variables, non_trainable, strict=True)
        ]
        return {"centred": y_pred - jnp.mean(y_pred, axis=0), "raw": y_pred}, counted


def own_predict_step_model() -> OwnPredictStep:
    keras.utils.set_random_seed(8)
    model = OwnPredictStep()
    model.build((None, 5))
    return model


def test_own_predict_step_predicts_like_keras(data):
    x, _, _, _ = data
    expected, actual = twins(own_predict_step_model)
    trainer = jax_dp.Trainer(4)

    for _ in range(2):
        want = expected.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
        got = trainer.predict(actual, x, global_batch_size=GLOBAL_BATCH, verbose=0)
        assert sorted(got) == ["centred", "raw"]
        for name in want:
            assert got[name].shape == (99, 2)
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert float(actual.batches.numpy()) == float(expected.batches.numpy()) == 8.0  # 4 batches, twice


def test_a_second_fit_traces_nothing():
    x, y = rows(99)
    model = own_train_step_model()
    trainer = jax_dp.Trainer(2)
    key = f"train_{model.name}"

    trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    first = TRACES[key]
    trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)

    assert first == 2  # the full batches (sharded) and the last batch of 3 rows (on every device), once each
    assert TRACES[key] == first


class RecordsModel(keras.callbacks.Callback):
    """What a batch callback sees through ``self.model``: the kernel's sum and the loss tracker."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[float, float]] = []

    def on_train_batch_end(self, batch, logs=None):
        model = self.model
        self.seen.append((float(np.sum(model.dense.kernel.numpy())), float(model.loss_tracker.result())))


def test_batch_callbacks_and_schedules_see_and_change_the_model_as_in_keras():
    x, y = rows(99)
    expected, actual = twins(own_train_step_model)
    callbacks = {
        side: [RecordsModel(), keras.callbacks.LearningRateScheduler(lambda epoch: 0.02 / (1 + epoch))]
        for side in ("keras", "trainer")
    }
    want = expected.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks["keras"])

    got = jax_dp.Trainer(2).fit(
        actual, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks["trainer"]
    )

    np.testing.assert_allclose(callbacks["trainer"][0].seen, callbacks["keras"][0].seen, rtol=1e-5)
    assert len(callbacks["trainer"][0].seen) == 8
    assert_history_close(want.history, got.history)  # learning_rate included
    assert_weights_close(expected, actual)


class StopAt(keras.callbacks.Callback):
    """Interrupts a fit at one batch of one epoch, as a crash would."""

    def __init__(self, epoch: int, batch: int) -> None:
        super().__init__()
        self.at, self.epoch = (epoch, batch), -1

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise KeyboardInterrupt


def test_an_interrupted_fit_resumes_from_its_checkpoint_like_an_uninterrupted_one(tmp_path):
    x, y = rows(99)
    expected, interrupted = twins(own_train_step_model)
    want = expected.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    options = {"global_batch_size": GLOBAL_BATCH, "epochs": 2, "shuffle": False, "verbose": 0}
    with pytest.raises(KeyboardInterrupt):
        jax_dp.Trainer(2).fit(
            interrupted,
            x,
            y,
            checkpoint_dir=str(tmp_path),
            checkpoint_every_steps=2,
            callbacks=[StopAt(1, 3)],
            **options,
        )
    assert dp_core.latest_checkpoint(tmp_path).step == 2  # mid-epoch: the loss tracker's sums saved with it

    resumed = own_train_step_model()  # a fresh model: the checkpoint's weights replace its own
    got = jax_dp.Trainer(4).fit(resumed, x, y, checkpoint_dir=str(tmp_path), **options)

    assert_history_close(want.history, got.history)
    assert_weights_close(expected, resumed)


@pytest.mark.parametrize(
    ("options", "compile_options", "message"),
    [
        ({"optimizer": optax.sgd(0.1)}, {}, r"replaces the compiled optimizer.*overrides train_step"),
        ({"batch_norm": "per_replica"}, {}, r'batch_norm="per_replica".*overrides train_step'),
        ({}, None, r"not compiled: OwnTrainStep overrides train_step"),
    ],
    ids=["optax", "per-replica-batch-norm", "not-compiled"],
)
def test_what_cannot_apply_to_an_own_train_step_is_an_error(options, compile_options, message):
    x, y = rows(99)
    model = OwnTrainStep()
    if compile_options is not None:
        model.compile(optimizer="sgd", **compile_options)
    with pytest.raises(ValueError, match=message):
        jax_dp.Trainer(2, **options).fit(model, x, y, global_batch_size=GLOBAL_BATCH)


class ForgetsTheMetrics(OwnTrainStep):
    def train_step(self, state: Any, data: Any) -> tuple[dict[str, Any], Any]:
        logs, (trainable, non_trainable, optimizer_variables, _) = super().train_step(state, data)
        return logs, (trainable, non_trainable, optimizer_variables)


def test_a_step_returning_another_state_shape_is_named():
    x, y = rows(99)
    model = ForgetsTheMetrics()
    model.build((None, 5))
    model.compile(optimizer="sgd")
    with pytest.raises(ValueError, match=r"train_step must return its state as \(trainable_variables, .*returned 3"):
        jax_dp.Trainer(2).fit(model, x, y, global_batch_size=GLOBAL_BATCH, verbose=0)
