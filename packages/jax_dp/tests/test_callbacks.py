"""Keras callbacks: called once per event, with aggregated logs; stop decisions honoured."""

from __future__ import annotations

import keras
import pytest
from jax_dp_helpers import GLOBAL_BATCH, dense_bn_model

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


def test_terminate_on_nan_stops_mid_epoch(data):
    x, y, _, _ = data
    model = dense_bn_model("sgd")
    model.compile(optimizer=keras.optimizers.SGD(1e30), loss="mse")  # diverges to inf/nan at once

    history = jax_dp.Trainer(2).fit(
        model,
        x * 1e10,
        y,
        global_batch_size=GLOBAL_BATCH,
        epochs=3,
        callbacks=[keras.callbacks.TerminateOnNaN()],
        verbose=0,
    )

    assert len(history.epoch) == 1
