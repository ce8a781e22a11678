"""Keras callbacks: called once per event, with aggregated logs; stop decisions honoured; a
non-finite loss stops training (or its step is skipped)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from jax_dp_helpers import GLOBAL_BATCH, assert_history_close, assert_weights_close, dense_bn_model, make_data

import dp_core
import jax_dp

pytestmark = pytest.mark.timeout(240)


class Recorder(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []
        self.epoch_logs: list[dict] = []

    def on_train_begin(self, logs=None):
        self.events.append("train_begin")

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(f"epoch_end_{epoch}")
        self.epoch_logs.append(dict(logs))

    def on_train_batch_end(self, batch, logs=None):
        self.events.append("batch_end")

    def on_train_end(self, logs=None):
        self.events.append("train_end")


def test_callbacks_fire_once_per_event_with_validation_logs(data):
    x, y, x_val, y_val = data
    recorder = Recorder()
    trainer = jax_dp.Trainer(4)
    model = dense_bn_model("sgd")

    history = trainer.fit(
        model,
        x,
        y,
        global_batch_size=GLOBAL_BATCH,
        epochs=2,
        validation_data=(x_val, y_val),
        callbacks=[recorder],
        verbose=0,
    )

    steps = 4  # ceil(99 / 32)
    expected = ["train_begin", *["batch_end"] * steps, "epoch_end_0", *["batch_end"] * steps, "epoch_end_1"]
    assert recorder.events == [*expected, "train_end"]
    assert set(recorder.epoch_logs[-1]) == {"loss", "mae", "val_loss", "val_mae"}
    assert recorder.epoch_logs[-1]["loss"] == pytest.approx(history.history["loss"][-1])
    # The last epoch's validation logs are the trained model's exact evaluation.
    evaluation = trainer.evaluate(model, x_val, y_val, global_batch_size=GLOBAL_BATCH, return_dict=True, verbose=0)
    assert recorder.epoch_logs[-1]["val_loss"] == pytest.approx(evaluation["loss"], abs=1e-6)


def test_early_stopping_stops_every_replica_and_restores_best_weights(data):
    x, y, _, _ = data
    model = dense_bn_model("sgd")
    # min_delta larger than any improvement: epoch 0 is the best, epoch 1 "fails", training stops.
    stopper = keras.callbacks.EarlyStopping(monitor="loss", min_delta=1e3, patience=1, restore_best_weights=True)
    weights_after_first_epoch = []
    keep = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: epoch == 0 and weights_after_first_epoch.extend(model.get_weights())
    )

    history = jax_dp.Trainer(2).fit(
        model, x, y, global_batch_size=GLOBAL_BATCH, epochs=10, callbacks=[keep, stopper], verbose=0
    )

    assert history.epoch == [0, 1]
    assert stopper.stopped_epoch == 1
    for restored, best in zip(model.get_weights(), weights_after_first_epoch, strict=True):
        assert (restored == best).all()


def test_a_nonfinite_loss_stops_training_naming_epoch_and_step(data, tmp_path):
    x, y, _, _ = data
    x = x.copy()
    x[70] = np.nan  # global batch 2 of every epoch (shuffle=False)
    model = dense_bn_model("adam")
    with pytest.raises(jax_dp.NonFiniteLossError, match=r"epoch 0, step 2 \(both counted from 0\).*'skip'") as raised:
        jax_dp.Trainer(2).fit(
            model,
            x,
            y,
            global_batch_size=GLOBAL_BATCH,
            epochs=2,
            shuffle=False,
            checkpoint_dir=str(tmp_path),
            checkpoint_every_steps=1,
            callbacks=[keras.callbacks.EarlyStopping(monitor="loss")],  # no TerminateOnNaN: the trainer's stop
            verbose=0,
        )
    assert (raised.value.epoch, raised.value.step) == (0, 2)
    # the step was not applied: weights, BatchNorm statistics and optimizer are those of the last checkpoint
    newest = dp_core.latest_checkpoint(tmp_path)
    assert (newest.epoch, newest.step) == (0, 2)
    for mine, saved in zip(model.get_weights(), newest.weights, strict=True):
        np.testing.assert_array_equal(mine, saved)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 2


def test_terminate_on_nan_applies_a_nonfinite_short_last_batch_as_model_fit_does(data):
    # the 3-row last batch of a BatchNormalization model runs whole on every device: that step too is
    # applied under TerminateOnNaN (the weights go NaN), and training stops after it, as in model.fit
    x, y, _, _ = data
    x = x.copy()
    x[97] = np.inf
    expected = dense_bn_model()
    keras_history = expected.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, callbacks=[keras.callbacks.TerminateOnNaN()], verbose=0
    )
    model = dense_bn_model()
    history = jax_dp.Trainer(2).fit(
        model,
        x,
        y,
        global_batch_size=GLOBAL_BATCH,
        epochs=2,
        shuffle=False,
        callbacks=[keras.callbacks.TerminateOnNaN()],
        verbose=0,
    )
    assert history.epoch == keras_history.epoch == [0]
    assert np.isnan(model.get_weights()[0]).all() and np.isnan(expected.get_weights()[0]).all()
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 4


def _skip_nan_rows(num_replicas):
    x, y, _, _ = make_data()
    x[60] = np.nan  # in global batch 1, in replica 1's half of it when there are 2
    model = dense_bn_model("adam")
    trainer = jax_dp.Trainer(num_replicas, on_nonfinite_loss="skip")
    callbacks = [keras.callbacks.TerminateOnNaN()]
    history = trainer.fit(
        model, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, callbacks=callbacks, verbose=0
    )
    return model, history


def test_skip_leaves_the_step_out_on_every_replica():
    with pytest.warns(RuntimeWarning, match=r"epoch 1, step 1 .*skipped that step's update on every replica"):
        expected, expected_history = _skip_nan_rows(1)
    assert expected_history.epoch == [0, 1]  # TerminateOnNaN never saw a NaN
    assert np.isfinite(expected_history.history["loss"]).all()
    assert int(keras.ops.convert_to_numpy(expected.optimizer.iterations)) == 2 * 4 - 2  # one step skipped per epoch

    with pytest.warns(RuntimeWarning, match=r"epoch 0, step 1 "):
        model, history = _skip_nan_rows(2)
    # replica 1 alone saw the NaN; had replica 0 applied its half, the weights would differ
    for mine, theirs in zip(model.get_weights(), expected.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    np.testing.assert_allclose(history.history["loss"], expected_history.history["loss"], rtol=1e-5)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 6


def test_unknown_nonfinite_loss_mode():
    with pytest.raises(ValueError, match=r"on_nonfinite_loss must be one of \('stop', 'skip'\), got 'ignore'"):
        jax_dp.Trainer(2, on_nonfinite_loss="ignore")  # type: ignore[arg-type]


class StateAtBatchEnd(keras.callbacks.Callback):
    """Records the model's weights and optimizer variables at every batch end, as a callback
    that saves or inspects the model would read them."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[list[np.ndarray]] = []
        self.optimizer_variables: list[list[np.ndarray]] = []

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append(self.model.get_weights())
        variables = self.model.optimizer.variables
        self.optimizer_variables.append([np.array(keras.ops.convert_to_numpy(v)) for v in variables])


def _assert_snapshots_equal(expected: list[list[np.ndarray]], actual: list[list[np.ndarray]]) -> None:
    assert len(actual) == len(expected)
    for step, (want, got) in enumerate(zip(expected, actual, strict=True)):
        for w, g in zip(want, got, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"batch end {step}")


def test_batch_end_callbacks_see_the_current_weights_and_optimizer_state(data, tmp_path):
    # ModelCheckpoint(save_freq=3) and a recorder read the model after every step, while the
    # fit also writes its own checkpoints mid-epoch (whose write-back once left the optimizer
    # variables on buffers the next step deleted).
    x, y, _, _ = data
    runs = {}
    for name in ("keras", "jax_dp"):
        model = dense_bn_model("adam")
        recorder = StateAtBatchEnd()
        saver = keras.callbacks.ModelCheckpoint(
            str(tmp_path / f"{name}-{{epoch}}-{{batch}}.weights.h5"), save_weights_only=True, save_freq=3
        )
        if name == "keras":
            model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, callbacks=[recorder, saver], verbose=0)
        else:
            jax_dp.Trainer(2).fit(
                model,
                x,
                y,
                global_batch_size=GLOBAL_BATCH,
                epochs=2,
                shuffle=False,
                callbacks=[recorder, saver],
                checkpoint_dir=str(tmp_path / "checkpoints"),
                checkpoint_every_steps=2,
                verbose=0,
            )
        runs[name] = model, recorder

    (expected, expected_recorder), (model, recorder) = runs["keras"], runs["jax_dp"]
    _assert_snapshots_equal(expected_recorder.weights, recorder.weights)
    _assert_snapshots_equal(expected_recorder.optimizer_variables, recorder.optimizer_variables)
    saved = sorted(path.name.removeprefix("keras-") for path in tmp_path.glob("keras-*"))
    assert saved == sorted(path.name.removeprefix("jax_dp-") for path in tmp_path.glob("jax_dp-*")) and saved
    for name in saved:
        expected.load_weights(tmp_path / f"keras-{name}")
        model.load_weights(tmp_path / f"jax_dp-{name}")
        _assert_snapshots_equal([expected.get_weights()], [model.get_weights()])


class Meddler(keras.callbacks.Callback):
    """Lowers the learning rate before batch 1 and halves the weights after batches 2 and 3
    (the epoch's last) of each epoch."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 1:
            self.model.optimizer.learning_rate = 0.5 * float(self.model.optimizer.learning_rate)

    def on_train_batch_end(self, batch, logs=None):
        if batch >= 2:
            self.model.set_weights([0.5 * w for w in self.model.get_weights()])


def test_weights_and_learning_rate_set_by_batch_callbacks_apply_from_the_next_step(data, tmp_path):
    x, y, _, _ = data
    expected = dense_bn_model("adam")
    initial = expected.get_weights()
    expected_history = expected.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, callbacks=[Meddler()], verbose=0
    )
    model = dense_bn_model("adam", seed=7)
    model.set_weights(initial)

    history = jax_dp.Trainer(2).fit(
        model,
        x,
        y,
        global_batch_size=GLOBAL_BATCH,
        epochs=2,
        shuffle=False,
        callbacks=[Meddler()],
        checkpoint_dir=str(tmp_path),
        checkpoint_every_steps=3,  # right after a change: the checkpoint must keep it
        verbose=0,
    )

    assert float(model.optimizer.learning_rate) == pytest.approx(0.01 / 4)
    assert_weights_close(expected, model)
    assert_history_close(expected_history.history, history.history)


class BatchLogs(keras.callbacks.Callback):
    """Reads only its logs, at every batch end."""

    def __init__(self) -> None:
        super().__init__()
        self.logs: list[dict] = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append(dict(logs))


def test_a_callback_reading_only_logs_gets_keras_logs_and_the_model_is_written_only_at_epoch_ends(data):
    x, y, _, _ = data
    runs = {}
    for name in ("keras", "jax_dp"):
        model, recorder = dense_bn_model("adam"), BatchLogs()
        if name == "keras":
            model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, callbacks=[recorder], verbose=0)
        else:
            # Through a closure, not the callback's own model (which would ask for the current weights):
            # Keras replaces a variable's value object whenever the variable is written.
            values = []
            watch = keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda batch, logs, model=model, values=values: values.append(model.weights[0].value)
            )
            trainer = jax_dp.Trainer(2)
            trainer.fit(
                model,
                x,
                y,
                global_batch_size=GLOBAL_BATCH,
                epochs=2,
                shuffle=False,
                callbacks=[recorder, watch],
                verbose=0,
            )
            assert len({id(value) for value in values}) == 2  # the epoch's first state, then epoch 0's end
        runs[name] = model, recorder.logs

    (expected, expected_logs), (model, logs) = runs["keras"], runs["jax_dp"]
    assert len(logs) == len(expected_logs) == 8
    for want, got in zip(expected_logs, logs, strict=True):
        assert_history_close(want, got)
        assert all(isinstance(value, float) for value in got.values())
    assert_weights_close(expected, model)


class StopsAt(keras.callbacks.Callback):
    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            self.model.stop_training = True


@pytest.mark.parametrize("how", ["callback", "closure"])
def test_a_batch_callback_stopping_training_ends_it_after_that_batch(data, how):
    # The next step may already run when the hook decides: it must be dropped.
    x, y, _, _ = data
    runs = {}
    for name in ("keras", "jax_dp"):
        model = dense_bn_model("adam")
        if how == "callback":
            stop = StopsAt(1)
        else:  # a closure over the model: Keras's callback never reads its own model
            stop = keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda batch, logs, model=model: setattr(model, "stop_training", batch == 1)
            )
        if name == "keras":
            history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, callbacks=[stop], verbose=0)
        else:
            history = jax_dp.Trainer(2).fit(
                model, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, callbacks=[stop], verbose=0
            )
        runs[name] = model, history

    (expected, expected_history), (model, history) = runs["keras"], runs["jax_dp"]
    assert history.epoch == expected_history.epoch == [0]
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 2
    assert_weights_close(expected, model)
    assert_history_close(expected_history.history, history.history)
