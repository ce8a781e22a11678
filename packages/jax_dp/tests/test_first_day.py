"""What a user expects of a trainer on the first day (issue 45): mixed precision on one line, throughput
in the logs, Keras's logging callbacks, on 2 replicas against ``model.fit`` on one device."""

from __future__ import annotations

import contextlib
import csv
import os
import time
from collections.abc import Iterator

import keras
import numpy as np
import pytest

import jax_dp

pytestmark = pytest.mark.timeout(240)

EPOCHS = 3
# A step's gradient is two halves' sums, each rounded to the compute dtype: model.fit rounds one.
ROUNDING = {"mixed_bfloat16": 1e-2, "mixed_float16": 1e-3}


@pytest.fixture(scope="module")
def trainer() -> jax_dp.Trainer:
    return jax_dp.Trainer(num_replicas=2)


@contextlib.contextmanager
def dtype_policy(name: str) -> Iterator[None]:
    """``keras.mixed_precision.set_global_policy(name)`` while the block runs: the one line a user writes."""
    before = keras.config.dtype_policy()
    keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(before)


def _regressor() -> keras.Model:
    """Built under the global policy; its output layer in float32, as Keras advises."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1, dtype="float32")]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model


def _evaluated_with(weights: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """``model.evaluate`` on one device of a model holding ``weights``, under the global policy."""
    model = _regressor()
    model.set_weights(weights)
    return model.evaluate(x, y, batch_size=32, return_dict=True, verbose=0)


def _largest_difference(first: list[np.ndarray], second: list[np.ndarray]) -> float:
    return max(float(np.abs(a.astype("float64") - b).max()) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_on_one_line_trains_as_model_fit_under_it(data, trainer, policy):
    """The policy's compute dtype, float32 variables (float16: Keras's loss-scaling optimizer): History
    and weights within the compute dtype's rounding of ``model.fit``'s under the same policy, and
    ``evaluate`` of the trained weights gives ``model.evaluate``'s, which float32 compute does not."""
    x, y, _, _ = data
    fit_options = dict(epochs=EPOCHS, shuffle=False, verbose=0)
    with dtype_policy(policy):
        reference, mine = _regressor(), _regressor()
        expected = reference.fit(x, y, batch_size=32, **fit_options).history
        history = trainer.fit(mine, x, y, global_batch_size=32, **fit_options).history
        hidden = mine.layers[0]
        assert hidden.compute_dtype == policy.removeprefix("mixed_") and hidden.kernel.dtype == "float32"
        assert type(mine.optimizer).__name__ == type(reference.optimizer).__name__
        evaluated = trainer.evaluate(mine, x, y, global_batch_size=32, return_dict=True, verbose=0)
        expected_evaluation = _evaluated_with(mine.get_weights(), x, y)
    with dtype_policy("float32"):
        in_float32 = _evaluated_with(mine.get_weights(), x, y)
    rounding = ROUNDING[policy]
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=rounding)
    assert _largest_difference(mine.get_weights(), reference.get_weights()) < rounding
    for name, value in expected_evaluation.items():
        np.testing.assert_allclose(evaluated[name], value, rtol=1e-6, err_msg=name)
    assert abs(in_float32["loss"] - evaluated["loss"]) > 1e-5  # the replicas computed in the policy's dtype


class SlowSteps(keras.callbacks.Callback):
    """Sleeps before every training step and at every validation's start: time Throughput must count
    (the steps') and time it must not (validation's)."""

    def __init__(self, step_seconds: float, validation_seconds: float) -> None:
        super().__init__()
        self.step_seconds, self.validation_seconds = step_seconds, validation_seconds

    def on_train_batch_begin(self, batch, logs=None):
        time.sleep(self.step_seconds)

    def on_test_begin(self, logs=None):
        time.sleep(self.validation_seconds)


def test_throughput_puts_samples_per_second_and_step_time_in_history_and_the_progress_bar(data, trainer, capsys):
    """4 steps an epoch of 32 rows over 2 replicas, each step slept 0.05 s: at least that a step, the
    samples the global batch's (32 / step time), validation's 1 s left out; model.fit's run the same
    callback and gets the same two keys beside its own."""
    x, y, x_val, y_val = data
    options = dict(epochs=2, shuffle=False, validation_data=(x_val, y_val))
    callbacks = [jax_dp.Throughput(), SlowSteps(0.05, 1.0)]
    began = time.perf_counter()
    history = trainer.fit(_regressor(), x, y, global_batch_size=32, callbacks=callbacks, **options)
    seconds = time.perf_counter() - began
    bar = capsys.readouterr().out
    logs = history.history
    assert sorted(history.params) == ["epochs", "steps", "verbose"]  # model.fit's: nothing added for Throughput
    assert len(logs["seconds_per_step"]) == len(logs["samples_per_second"]) == 2
    for step_seconds, samples in zip(logs["seconds_per_step"], logs["samples_per_second"], strict=True):
        assert 0.05 <= step_seconds < 1.0
        assert samples == pytest.approx(32 / step_seconds)
    assert sum(4 * step_seconds + 1.0 for step_seconds in logs["seconds_per_step"]) < seconds
    assert bar.count("samples_per_second: ") == 2 and bar.count("seconds_per_step: ") == 2
    expected = _regressor().fit(x, y, batch_size=32, callbacks=[jax_dp.Throughput(32)], verbose=0, **options).history
    assert (
        set(logs) == set(expected) == {"loss", "mae", "val_loss", "val_mae", "samples_per_second", "seconds_per_step"}
    )


def _csv_rows(path) -> list[dict[str, float]]:
    with open(path, newline="") as opened:
        return [{name: float(value) for name, value in row.items()} for row in csv.DictReader(opened)]


def test_csv_logger_and_a_tensorboard_writer_write_model_fit_s_rows_once(data, trainer, tmp_path):
    """Keras's CSVLogger on 2 replicas: one writer (process 0), one row an epoch, each of model.fit's
    columns with model.fit's value; and getting-started-jax.md's TensorBoard path (tensorboardX's
    SummaryWriter in a callback, no tensorflow) writes those values as scalars."""
    x, y, x_val, y_val = data
    options = dict(epochs=3, shuffle=False, validation_data=(x_val, y_val), verbose=0)
    logger = keras.callbacks.CSVLogger(str(tmp_path / "mine.csv"))
    scalars = EpochScalars(str(tmp_path / "runs"))
    trainer.fit(_regressor(), x, y, global_batch_size=32, callbacks=[logger, scalars], **options)
    _regressor().fit(x, y, batch_size=32, callbacks=[keras.callbacks.CSVLogger(str(tmp_path / "keras.csv"))], **options)
    mine, expected = _csv_rows(tmp_path / "mine.csv"), _csv_rows(tmp_path / "keras.csv")
    assert [row["epoch"] for row in mine] == [row["epoch"] for row in expected] == [0, 1, 2]
    assert list(mine[0]) == list(expected[0]) == ["epoch", "loss", "mae", "val_loss", "val_mae"]
    for got, want in zip(mine, expected, strict=True):
        np.testing.assert_allclose(list(got.values()), list(want.values()), rtol=1e-5, atol=1e-6)
    scalars.writer.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # tests_* install it

    events = EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(name for name in mine[0] if name != "epoch")
    for name in events.Tags()["scalars"]:
        logged = events.Scalars(name)
        assert [event.step for event in logged] == [0, 1, 2]
        np.testing.assert_allclose([event.value for event in logged], [row[name] for row in mine], rtol=1e-6)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["keras.csv", "mine.csv", "runs"]


class EpochScalars(keras.callbacks.Callback):
    """The getting-started page's callback, as printed there: each epoch's logs as TensorBoard scalars."""

    def __init__(self, log_dir):
        # imported here: sessions that only collect this file lack it
        from tensorboardX import SummaryWriter

        super().__init__()
        self.writer = SummaryWriter(log_dir)

    def on_epoch_end(self, epoch, logs=None):
        for name, value in (logs or {}).items():
            self.writer.add_scalar(name, float(value), epoch)
        self.writer.flush()


def test_estimate_counts_a_replica_s_memory_before_anything_is_placed(data):
    """Before training: counted per replica (16 of 32 rows) under the trainer's shard mode, next to the
    host's memory over the 2 replicas (CPU devices have none of their own)."""
    x, y, _, _ = data
    estimate = jax_dp.Trainer(num_replicas=2, shard="full").estimate(_regressor(), x, y, global_batch_size=32)
    assert (estimate.device, estimate.per_replica_batch_size, estimate.shard) == ("cpu:0", 16, "full")
    assert estimate.device_memory == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    mine = estimate.for_shard("full")  # Dense(5 -> 16) 96 and Dense(16 -> 1) 17 float32 weights; SGD: a step counter
    assert (mine.weights, mine.gradients, mine.gathered) == (113 * 2, 113 * 2, 2 * 96 * 4)
    assert mine.activations == 16 * (5 + 16 + 1) * 4 and estimate.fits
