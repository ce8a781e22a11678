"""A Trainer runs one call at a time: a call from a callback of a running call, or from another
thread, is refused at once with ``dp_core.TrainerBusy``; the running call goes on and the Trainer
works afterwards. (Before, a nested fit hung until ``collective_timeout`` and two threads raced on
the replicas' shared files: ``BadZipFile``.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import torch_dp_testing as testing

import dp_core
import torch_dp

# collective_timeout is small so that a nested call that waits on the replicas (as it did before)
# fails in seconds, not after torch's 1800 s; a refusal takes milliseconds.
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
REFUSED_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def trainer():
    with torch_dp.Trainer(num_replicas=2, collective_timeout=30) as started:
        yield started


def _reference(epochs: int = 2) -> tuple[keras.Model, list[np.ndarray]]:
    x, y = testing.data()
    reference = testing.dense_batchnorm_model("sgd")
    start = reference.get_weights()
    reference.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0)
    return reference, start


def _model(start: list[np.ndarray]) -> keras.Model:
    model = testing.dense_batchnorm_model("sgd", seed=1)
    model.set_weights(start)
    return model


def _assert_weights_equal(weights: list[np.ndarray], expected: list[np.ndarray]) -> None:
    for mine, theirs in zip(weights, expected, strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)


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


def test_calls_from_a_callback_are_refused_at_once_and_the_running_fit_goes_on(trainer):
    x, y = testing.data()
    reference, start = _reference()
    model = _model(start)
    nested = CallsAtFirstEpochEnd(
        {
            "fit": lambda: trainer.fit(model, x, y, global_batch_size=32, verbose=0),
            "evaluate": lambda: trainer.evaluate(model, x, y, global_batch_size=32, verbose=0),
            "predict": lambda: trainer.predict(model, x, global_batch_size=32, verbose=0),
            "close": trainer.close,
        }
    )
    trainer.fit(model, x, y, global_batch_size=32, epochs=2, shuffle=False, callbacks=[nested], verbose=0)
    for name, (error, seconds) in nested.outcomes.items():
        assert isinstance(error, dp_core.TrainerBusy), (name, error)
        assert (error.running, error.attempted, error.nested) == ("fit", name, True)
        assert seconds < REFUSED_WITHIN_S, (name, seconds)
        assert f"torch_dp.Trainer.{name}() was refused: this Trainer's fit() is still running" in str(error)
        assert "a callback" in str(error) and "after fit() returns" in str(error)
    assert sorted(nested.outcomes) == ["close", "evaluate", "fit", "predict"]
    _assert_weights_equal(model.get_weights(), reference.get_weights())  # the refusals changed nothing


class PredictsInABatch(keras.callbacks.Callback):
    def __init__(self, trainer: torch_dp.Trainer, x: np.ndarray) -> None:
        super().__init__()
        self.trainer, self.x = trainer, x

    def on_train_batch_end(self, batch, logs=None):
        self.trainer.predict(self.model, self.x, global_batch_size=32, verbose=0)


def test_an_uncaught_refusal_ends_the_fit_at_once_and_frees_the_trainer(trainer):
    x, y = testing.data()
    reference, start = _reference(epochs=1)
    model = _model(start)
    started = time.monotonic()
    with pytest.raises(dp_core.TrainerBusy, match=r"predict\(\) was refused: this Trainer's fit\(\)"):
        trainer.fit(model, x, y, global_batch_size=32, callbacks=[PredictsInABatch(trainer, x)], verbose=0)
    assert time.monotonic() - started < 60  # the replicas' start included; no collective timed out
    model = _model(start)  # a fresh one: the refused fit had taken a step (and its momentum)
    trainer.fit(model, x, y, global_batch_size=32, epochs=1, shuffle=False, verbose=0)
    _assert_weights_equal(model.get_weights(), reference.get_weights())


def test_two_threads_one_fits_as_model_fit_and_the_other_is_refused_at_once(trainer):
    x, y = testing.data()
    reference, start = _reference()
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
                models[name], x, y, global_batch_size=32, epochs=2, shuffle=False,
                callbacks=[WaitsForTheRefusal()], verbose=0,
            )  # fmt: skip
        except Exception as error:
            outcomes[name] = (error, time.monotonic() - started)
            refused.set()

    threads = [threading.Thread(target=fit, args=(name,), name=name, daemon=True) for name in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    ran = [name for name, outcome in outcomes.items() if isinstance(outcome, keras.callbacks.History)]
    assert len(ran) == 1, outcomes
    (other,) = set(models) - set(ran)
    error, seconds = outcomes[other]
    assert isinstance(error, dp_core.TrainerBusy), error
    assert (error.running, error.attempted, error.nested) == ("fit", "fit", False)
    assert seconds < REFUSED_WITHIN_S
    assert f"in thread '{ran[0]}', and fit() was called from thread '{other}'" in str(error)
    assert "run it in another process" in str(error)
    _assert_weights_equal(models[ran[0]].get_weights(), reference.get_weights())
    _assert_weights_equal(models[other].get_weights(), start)  # the refused fit touched nothing
    # and the Trainer works afterwards, here on the refused thread's model given the trained weights
    expected = reference.evaluate(x, y, batch_size=32, return_dict=True, verbose=0)
    models[other].set_weights(reference.get_weights())
    logs = trainer.evaluate(models[other], x, y, global_batch_size=32, return_dict=True, verbose=0)
    for name, value in expected.items():
        np.testing.assert_allclose(logs[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_another_trainers_call_from_a_callback_is_refused_but_one_replica_runs(trainer):
    """Another Trainer of two replicas would stop the running call's replicas (one group per
    process): refused at once. One of one replica trains in this process alone: it runs."""
    x, y = testing.data()
    reference, start = _reference(epochs=1)
    model, alone = _model(start), _model(start)
    with torch_dp.Trainer(num_replicas=2, collective_timeout=30) as other:
        nested = CallsAtFirstEpochEnd(
            {
                "predict": lambda: other.predict(model, x, global_batch_size=32, verbose=0),
                "alone": lambda: torch_dp.Trainer(num_replicas=1).predict(alone, x, global_batch_size=32, verbose=0),
            }
        )
        trainer.fit(model, x, y, global_batch_size=32, epochs=1, shuffle=False, callbacks=[nested], verbose=0)
    error, seconds = nested.outcomes["predict"]
    assert isinstance(error, dp_core.TrainerBusy), error
    assert (error.running, error.attempted, error.nested, seconds < REFUSED_WITHIN_S) == ("fit", "predict", True, True)
    assert "predict() was refused: another torch_dp.Trainer's fit() is still running" in str(error)
    predictions, _ = nested.outcomes["alone"]
    np.testing.assert_allclose(predictions, alone.predict(x, batch_size=32, verbose=0), atol=1e-6)
    _assert_weights_equal(model.get_weights(), reference.get_weights())
