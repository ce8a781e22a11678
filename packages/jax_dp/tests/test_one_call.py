"""A Trainer runs one call at a time: a call from a callback of a running call, or from another
thread, is refused at once with ``dp_core.TrainerBusy``; the running call goes on and the Trainer
works afterwards. (Before, a fit nested in a callback trained the same model in the middle of the
running fit, which went on from weights neither call meant; two threads trained at once.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
from jax_dp_helpers import GLOBAL_BATCH, assert_weights_close, dense_bn_model

import dp_core
import jax_dp
from jax_dp._processes import group

pytestmark = pytest.mark.timeout(180)
REFUSED_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def trainer() -> jax_dp.Trainer:
    return jax_dp.Trainer(num_replicas=2)


def _reference(x: np.ndarray, y: np.ndarray, epochs: int = 2) -> tuple[keras.Model, list[np.ndarray]]:
    reference = dense_bn_model()
    start = reference.get_weights()
    reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0)
    return reference, start


def _model(start: list[np.ndarray]) -> keras.Model:
    model = dense_bn_model(seed=2)
    model.set_weights(start)
    return model


class CallsAtFirstEpochEnd(keras.callbacks.Callback):
    """Makes each call at the end of epoch 0 and records what each raised and how fast."""

    def __init__(self, calls: dict[str, Callable[[], Any]]) -> None:
        super().__init__()
        self.calls, self.outcomes = calls, {}

    def on_epoch_end(self, epoch, logs=None):
        for name, call in self.calls.items() if epoch == 0 else ():
            started = time.monotonic()
            try:
                self.outcomes[name] = (call(), time.monotonic() - started)
            except Exception as error:  # whatever it is: the test asserts the type
                self.outcomes[name] = (error, time.monotonic() - started)


def test_calls_from_a_callback_are_refused_at_once_and_the_running_fit_goes_on(trainer, data, monkeypatch):
    x, y, _, _ = data
    reference, start = _reference(x, y)
    model = _model(start)
    failures: list[BaseException] = []
    monkeypatch.setattr(group, "record_failure", failures.append)  # a refusal is no failure of the run
    nested = CallsAtFirstEpochEnd(
        {
            "fit": lambda: trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, verbose=0),
            "evaluate": lambda: trainer.evaluate(model, x, y, global_batch_size=GLOBAL_BATCH, verbose=0),
            "predict": lambda: trainer.predict(model, x, global_batch_size=GLOBAL_BATCH, verbose=0),
        }
    )
    trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, callbacks=[nested], verbose=0)
    assert sorted(nested.outcomes) == ["evaluate", "fit", "predict"]
    for name, (error, seconds) in nested.outcomes.items():
        assert isinstance(error, dp_core.TrainerBusy), (name, error)
        assert (error.running, error.attempted, error.nested) == ("fit", name, True)
        assert seconds < REFUSED_WITHIN_S, (name, seconds)
        assert f"jax_dp.Trainer.{name}() was refused: this Trainer's fit() is still running" in str(error)
        assert "a callback" in str(error) and "after fit() returns" in str(error)
    assert failures == []
    assert_weights_close(reference, model)  # the refused calls trained nothing in between


class PredictsInABatch(keras.callbacks.Callback):
    def __init__(self, trainer: jax_dp.Trainer, x: np.ndarray) -> None:
        super().__init__()
        self.trainer, self.x = trainer, x

    def on_train_batch_end(self, batch, logs=None):
        self.trainer.predict(self.model, self.x, global_batch_size=GLOBAL_BATCH, verbose=0)


def test_an_uncaught_refusal_ends_the_fit_and_frees_the_trainer(trainer, data):
    x, y, _, _ = data
    reference, start = _reference(x, y, epochs=1)
    with pytest.raises(dp_core.TrainerBusy, match=r"predict\(\) was refused: this Trainer's fit\(\)"):
        trainer.fit(_model(start), x, y, global_batch_size=GLOBAL_BATCH, callbacks=[PredictsInABatch(trainer, x)])
    model = _model(start)
    trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(reference, model)


def test_two_threads_one_fits_as_model_fit_and_the_other_is_refused_at_once(trainer, data):
    x, y, _, _ = data
    reference, start = _reference(x, y)
    refused = threading.Event()

    class WaitsForTheRefusal(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):  # the running fit is surely still running
            refused.wait(timeout=30)

    models = {"first": _model(start), "second": _model(start)}
    outcomes: dict[str, Any] = {}
    both_ready = threading.Barrier(2)

    def fit(name: str) -> None:
        both_ready.wait(timeout=30)
        started = time.monotonic()
        try:
            outcomes[name] = trainer.fit(
                models[name], x, y, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False,
                callbacks=[WaitsForTheRefusal()], verbose=0,
            )  # fmt: skip
        except Exception as error:
            outcomes[name] = (error, time.monotonic() - started)
            refused.set()

    threads = [threading.Thread(target=fit, args=(name,), name=name, daemon=True) for name in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    ran = [name for name, outcome in outcomes.items() if isinstance(outcome, keras.callbacks.History)]
    assert len(ran) == 1, outcomes
    (other,) = set(models) - set(ran)
    error, seconds = outcomes[other]
    assert isinstance(error, dp_core.TrainerBusy), error
    assert (error.running, error.attempted, error.nested) == ("fit", "fit", False)
    assert seconds < REFUSED_WITHIN_S
    assert f"in thread '{ran[0]}', and fit() was called from thread '{other}'" in str(error)
    assert "use another Trainer" in str(error)
    assert_weights_close(reference, models[ran[0]])
    for untouched, weight in zip(models[other].get_weights(), start, strict=True):
        np.testing.assert_array_equal(untouched, weight)  # the refused fit did nothing
    # and the Trainer works afterwards, here on the refused thread's model given the trained weights
    expected = reference.evaluate(x, y, batch_size=GLOBAL_BATCH, return_dict=True, verbose=0)
    models[other].set_weights(reference.get_weights())
    logs = trainer.evaluate(models[other], x, y, global_batch_size=GLOBAL_BATCH, return_dict=True, verbose=0)
    for name, value in expected.items():
        np.testing.assert_allclose(logs[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
