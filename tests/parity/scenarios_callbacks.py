"""Parity scenarios: What callbacks change in the model or optimizer, at any hook, and how they stop
training.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from parity.models import BATCH_SIZE, mlp, tabular
from parity.runners import Runner
from parity.scenarios import _fit, everywhere, outcome, scenario


@scenario("fit.callbacks", "fit.validation_data", "compile.optimizer")
def swap_ema_weights_validation(run: Runner) -> Any:
    """`SwapEMAWeights(swap_on_epoch=True)` with `use_ema=True`: validation and epoch ends see the averages."""
    x, y = tabular("swap_ema_weights_validation")
    validation = tabular("swap_ema_weights_validation/validation", 40)
    model = mlp("swap_ema_weights_validation", optimizer=lambda: keras.optimizers.SGD(0.2, use_ema=True))
    swap = keras.callbacks.SwapEMAWeights(swap_on_epoch=True)
    history = _fit(run, model, x, y, epochs=3, validation_data=validation, callbacks=[swap])
    return outcome(run, history, x, y)


@scenario("evaluate.callbacks", "predict.callbacks", "compile.optimizer")
def swap_ema_weights_evaluate(run: Runner) -> Any:
    """`SwapEMAWeights()` passed to `evaluate` and `predict`: every replica uses the averages, not the weights."""
    x, y = tabular("swap_ema_weights_evaluate")
    model = mlp("swap_ema_weights_evaluate", optimizer=lambda: keras.optimizers.SGD(0.2, use_ema=True))
    model = _fit(run, model, x, y).model  # ends with the averages in the weights (``finalize_variable_values``)
    kernel = model.layers[0].kernel
    kernel.assign(kernel * 0.5)  # now the weights and their averages differ
    swap = [keras.callbacks.SwapEMAWeights()]
    evaluation = run.evaluate(model, x, y, batch_size=BATCH_SIZE, callbacks=swap, return_dict=True, verbose=0)
    predictions = run.predict(model, x, batch_size=BATCH_SIZE, callbacks=swap, verbose=0)
    return {"evaluate": evaluation, "predict": predictions, "weights": model.get_weights()}


class _ChangesAtHooks(keras.callbacks.Callback):
    """Changes weights and the learning rate at train, epoch and test hooks."""

    def on_train_begin(self, logs: dict | None = None) -> None:
        kernel = self.model.layers[0].kernel
        kernel.assign(kernel * 0.5)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if epoch == 1:
            self.model.optimizer.learning_rate.assign(0.05)
            kernel = self.model.layers[0].kernel
            kernel.assign(kernel + 0.05)

    def on_test_begin(self, logs: dict | None = None) -> None:
        bias = self.model.layers[-1].bias
        bias.assign(bias + 0.1)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        kernel = self.model.layers[-1].kernel
        kernel.assign(kernel * 0.9)


@scenario("fit.callbacks", "fit.validation_data")
def callback_changes_at_hooks(run: Runner) -> Any:
    """A callback changing weights (train, epoch, test begin; epoch end) and the learning rate (epoch begin)."""
    x, y = tabular("callback_changes_at_hooks")
    validation = tabular("callback_changes_at_hooks/validation", 40)
    model = mlp("callback_changes_at_hooks")
    history = _fit(run, model, x, y, epochs=3, validation_data=validation, callbacks=[_ChangesAtHooks()])
    return outcome(run, history, x, y)


class _ChangesAtBatches(keras.callbacks.Callback):
    """Changes weights at a batch begin and a batch end, and reads them at every batch end."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[list[np.ndarray]] = []

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if batch == 1:
            kernel = self.model.layers[0].kernel
            kernel.assign(kernel * 0.5)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if batch == 2:
            bias = self.model.layers[-1].bias
            bias.assign(bias - 0.2)
        self.weights.append(self.model.get_weights())


@scenario("fit.callbacks")
def callback_changes_at_batches(run: Runner) -> Any:
    """A callback changing weights at `on_train_batch_begin` and `on_train_batch_end`: the next step uses them."""
    x, y = tabular("callback_changes_at_batches")
    recorder = _ChangesAtBatches()
    history = _fit(run, mlp("callback_changes_at_batches"), x, y, callbacks=[recorder])
    return outcome(run, history, x, y, batch_weights=recorder.weights)


class _FreezesFirstLayer(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.model.layers[0].trainable = epoch != 1


@scenario("fit.callbacks", backends=("torch",))
def callback_freezes_layer(run: Runner) -> Any:
    """A callback setting a layer's `trainable` at epoch begin (Keras's jax `fit` refuses a change mid-fit)."""
    x, y = tabular("callback_freezes_layer")
    history = _fit(run, mlp("callback_freezes_layer"), x, y, epochs=3, callbacks=[_FreezesFirstLayer()])
    return outcome(run, history, x, y)


@scenario("fit.callbacks")
def terminate_on_nan(run: Runner) -> Any:
    """`TerminateOnNaN()`: an inf in row 40 makes step 1's loss NaN; the step is applied and training stops there."""
    x, y = tabular("terminate_on_nan")
    x[40, 0] = np.inf
    history = _fit(run, mlp("terminate_on_nan"), x, y, epochs=3, callbacks=[keras.callbacks.TerminateOnNaN()])
    return outcome(run, history, x, y)


# by design: without a TerminateOnNaN, a NaN loss stops training before its update, naming the step
@scenario(
    "feature.nonfinite_loss",
    errors=everywhere(("NonFiniteLossError",), "on_nonfinite_loss='skip'"),
)
def nonfinite_loss_raises(run: Runner) -> None:
    """No `TerminateOnNaN`: a NaN loss raises `NonFiniteLossError` before its update (`model.fit` applies it)."""
    x, y = tabular("nonfinite_loss_raises")
    x[40, 0] = np.inf
    _fit(run, mlp("nonfinite_loss_raises"), x, y)
