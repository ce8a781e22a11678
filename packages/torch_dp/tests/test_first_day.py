"""What a user expects of a trainer on the first day (issue 45): mixed precision on one line, throughput
in the logs, Keras's logging callbacks, on 2 replicas against ``model.fit`` on one device."""

from __future__ import annotations

import contextlib
import csv
import multiprocessing
import os
import time
from collections.abc import Iterator

import keras
import numpy as np
import pytest
import torch_dp_testing as testing

import torch_dp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

EPOCHS = 3


@contextlib.contextmanager
def dtype_policy(name: str) -> Iterator[None]:
    """``keras.mixed_precision.set_global_policy(name)`` while the block runs: the one line a user writes."""
    before = keras.config.dtype_policy()
    keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(before)


def _evaluated_with(weights: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """``model.evaluate`` on one device of a model holding ``weights``, under the global policy."""
    model = testing.mixed_precision_model()
    model.set_weights(weights)
    return model.evaluate(x, y, batch_size=32, return_dict=True, verbose=0)


def _largest_difference(first: list[np.ndarray], second: list[np.ndarray]) -> float:
    return max(float(np.abs(a.astype("float64") - b).max()) for a, b in zip(first, second, strict=True))


def test_mixed_bfloat16_on_one_line_trains_as_model_fit_under_it(two_replicas):
    """bfloat16 compute, float32 variables: the weights land within bfloat16's rounding of the halves'
    gradient sums of ``model.fit``'s under the same policy, nearer than float32's ``model.fit`` lands
    (so the replicas did compute in bfloat16), and ``evaluate`` of those weights gives ``model.evaluate``'s,
    which float32 compute does not (``mixed_float16``: test_losses_against_keras.py)."""
    x, y = testing.data()
    fit_options = dict(epochs=EPOCHS, shuffle=False, verbose=0)
    with dtype_policy("float32"):
        in_float32 = testing.mixed_precision_model()
        in_float32.fit(x, y, batch_size=32, **fit_options)
    with dtype_policy("mixed_bfloat16"):
        reference, mine = testing.mixed_precision_model(), testing.mixed_precision_model()
        expected = reference.fit(x, y, batch_size=32, **fit_options).history
        history = two_replicas.fit(mine, x, y, global_batch_size=32, **fit_options).history
        assert mine.layers[0].compute_dtype == "bfloat16" and mine.layers[0].kernel.dtype == "float32"
        evaluated = two_replicas.evaluate(mine, x, y, global_batch_size=32, return_dict=True, verbose=0)
        expected_evaluation = _evaluated_with(mine.get_weights(), x, y)
    with dtype_policy("float32"):
        evaluated_in_float32 = _evaluated_with(mine.get_weights(), x, y)
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-3)
    mine_to_keras = _largest_difference(mine.get_weights(), reference.get_weights())
    float32_to_keras = _largest_difference(in_float32.get_weights(), reference.get_weights())
    assert mine_to_keras < 3e-4 < float32_to_keras
    for name, value in expected_evaluation.items():
        np.testing.assert_allclose(evaluated[name], value, rtol=1e-6, err_msg=name)
    assert abs(evaluated_in_float32["loss"] - evaluated["loss"]) > 1e-5


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


def test_throughput_puts_samples_per_second_and_step_time_in_history_and_the_progress_bar(two_replicas, capsys):
    """4 steps an epoch of 32 rows over 2 replicas, each step slept 0.05 s: at least that a step, the
    samples the global batch's (32 / step time), validation's 1 s left out; model.fit's run the same
    callback and gets the same two keys beside its own."""
    x, y = testing.data()
    options = dict(epochs=2, shuffle=False, validation_data=testing.data(37, seed=1))
    callbacks = [torch_dp.Throughput(), SlowSteps(0.05, 1.0)]
    began = time.perf_counter()
    history = two_replicas.fit(
        testing.dense_batchnorm_model(), x, y, global_batch_size=32, callbacks=callbacks, **options
    )
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
    keras_model = testing.dense_batchnorm_model()
    expected = keras_model.fit(x, y, batch_size=32, callbacks=[torch_dp.Throughput(32)], verbose=0, **options).history
    assert (
        set(logs)
        == set(expected)
        == {"accuracy", "loss", "val_accuracy", "val_loss", "samples_per_second", "seconds_per_step"}
    )


def _csv_rows(path) -> list[dict[str, float]]:
    with open(path, newline="") as opened:
        return [{name: float(value) for name, value in row.items()} for row in csv.DictReader(opened)]


def test_csv_logger_and_a_tensorboard_writer_write_model_fit_s_rows_once(two_replicas, tmp_path):
    """Keras's CSVLogger on 2 replicas: one writer (the caller), one row an epoch, each of model.fit's
    columns with model.fit's value; and getting-started-torch.md's TensorBoard path (torch's own
    SummaryWriter in a callback, no tensorflow) writes those values as scalars."""
    x, y = testing.data()
    options = dict(epochs=3, shuffle=False, validation_data=testing.data(37, seed=1), verbose=0)
    logger = keras.callbacks.CSVLogger(str(tmp_path / "mine.csv"))
    scalars = EpochScalars(str(tmp_path / "runs"))
    two_replicas.fit(
        testing.dense_batchnorm_model(), x, y, global_batch_size=32, callbacks=[logger, scalars], **options
    )
    expected_logger = keras.callbacks.CSVLogger(str(tmp_path / "keras.csv"))
    testing.dense_batchnorm_model().fit(x, y, batch_size=32, callbacks=[expected_logger], **options)
    mine, expected = _csv_rows(tmp_path / "mine.csv"), _csv_rows(tmp_path / "keras.csv")
    assert [row["epoch"] for row in mine] == [row["epoch"] for row in expected] == [0, 1, 2]
    assert list(mine[0]) == list(expected[0]) == ["epoch", "accuracy", "loss", "val_accuracy", "val_loss"]
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
        from torch.utils.tensorboard import SummaryWriter

        super().__init__()
        self.writer = SummaryWriter(log_dir)

    def on_epoch_end(self, epoch, logs=None):
        for name, value in (logs or {}).items():
            self.writer.add_scalar(name, float(value), epoch)
        self.writer.flush()


def test_estimate_counts_a_replica_s_memory_before_any_replica_starts():
    """Before training: the factory's model built here, counted per replica (16 of 32 rows) under the
    trainer's shard mode next to the host's memory over 2 replicas; no worker process started."""
    x, y = testing.data()
    before = set(multiprocessing.active_children())
    trainer = torch_dp.Trainer(num_replicas=2, shard="optimizer")
    estimate = trainer.estimate(lambda: testing.dense_batchnorm_model("adam"), x, y, global_batch_size=32)
    assert set(multiprocessing.active_children()) == before
    assert (estimate.device, estimate.per_replica_batch_size, estimate.shard) == ("cpu", 16, "optimizer")
    assert estimate.device_memory == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    mine = estimate.for_shard("optimizer")  # 83 trainable float32 weights, 16 moving statistics
    assert (mine.weights, mine.gradients, mine.optimizer_state) == (99 * 4, 83 * 4, (2 * 83 * 4 + 8) // 2)
    assert mine.activations == 16 * (5 + 8 + 8 + 8 + 3) * 4 and estimate.fits
