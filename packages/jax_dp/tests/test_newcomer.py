"""What a first run shows: the progress bar's metrics from each epoch's first step, the line a
resumed fit prints, the error for a list of batches, and the note for one CPU device."""

import os
import shutil
import subprocess
import sys

import keras
import numpy as np
import pytest
from jax_dp_helpers import GLOBAL_BATCH, dense_bn_model

import jax_dp
from jax_dp._loop.reporting import STOP_CHECK_STEPS, BatchEndReporter

pytestmark = pytest.mark.timeout(240)


class BatchEndLogs(keras.callbacks.ProgbarLogger):
    """The progress bar, recording each batch end it gets: ``(epoch, batch, logs)``."""

    def __init__(self):
        super().__init__()
        self.ends = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        super().on_epoch_begin(epoch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append((self.epoch, batch, dict(logs or {})))
        super().on_train_batch_end(batch, logs)

    def first(self):
        """The logs of each epoch's first batch end."""
        return [
            logs for index, (epoch, _, logs) in enumerate(self.ends) if index == 0 or self.ends[index - 1][0] != epoch
        ]


def test_the_progress_bar_shows_the_metrics_from_the_first_step_of_every_epoch(data):
    """As ``model.fit``'s does: its logs at each epoch's first batch name the loss and metrics."""
    x, y, _, _ = data
    keras_bar, bar = BatchEndLogs(), BatchEndLogs()
    dense_bn_model().fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, callbacks=[keras_bar])
    jax_dp.Trainer(2).fit(
        dense_bn_model(), x, y, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, callbacks=[bar]
    )
    assert [sorted(logs) for logs in keras_bar.first()] == [["loss", "mae"]] * 2
    assert [sorted(logs) for logs in bar.first()] == [["loss", "mae"]] * 2
    for got, want in zip(bar.first(), keras_bar.first(), strict=True):
        np.testing.assert_allclose([got["loss"], got["mae"]], [want["loss"], want["mae"]], atol=1e-5)


def test_the_progress_bar_ends_each_epoch_at_its_last_step_with_the_epoch_logs(data):
    """The bar reads a step's logs once the next step runs, and the last step's after the epoch's
    steps: it still gets every epoch's first and last step, in order, the last with the logs the
    epoch ends with, as ``model.fit``'s does."""
    x, y, _, _ = data  # 99 rows: 4 steps an epoch
    bar = BatchEndLogs()
    history = jax_dp.Trainer(2).fit(
        dense_bn_model(), x, y, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, callbacks=[bar]
    )
    for epoch in (0, 1):
        batches = [batch for seen_epoch, batch, _ in bar.ends if seen_epoch == epoch]
        assert batches[0] == 0 and batches[-1] == 3 and batches == sorted(set(batches))
        last = next(logs for seen_epoch, batch, logs in bar.ends if (seen_epoch, batch) == (epoch, 3))
        np.testing.assert_allclose(
            [last["loss"], last["mae"]], [history.history["loss"][epoch], history.history["mae"][epoch]], rtol=1e-6
        )


def test_with_several_processes_the_progress_bar_is_reported_at_the_first_step_too():
    """Several processes report at the same steps (each report is a collective): the first, every
    ``STOP_CHECK_STEPS`` and the last, so process 0's bar has metrics from the first step."""
    callbacks = keras.callbacks.CallbackList(
        [], add_progbar=True, model=dense_bn_model(), verbose=1, epochs=1, steps=40
    )
    reporter = BatchEndReporter(callbacks, "train", steps=40)
    reporter.several_processes = True  # as jax.process_count() > 1 makes it; no collective is called
    assert not reporter.every_step and STOP_CHECK_STEPS == 16
    assert [step for step in range(40) if reporter.due(step)] == [0, 15, 31, 39]
    # in groups of 4 (steps_per_execution): the group's end that holds step 15, 31, then the last
    grouped = BatchEndReporter(callbacks, "train", steps=40)
    grouped.several_processes = True
    ends = [min(first + 3, 39) for first in range(0, 40, 4)]
    assert [end for first, end in zip(range(0, 40, 4), ends, strict=True) if grouped.due(end, first=first)] == [
        3, 15, 31, 39,
    ]  # fmt: skip


def _lines(text, prefix="jax_dp:"):
    return [line for line in text.splitlines() if line.startswith(prefix)]


def test_a_resumed_fit_says_where_it_starts_and_a_finished_one_that_nothing_is_left(data, tmp_path, capsys):
    x, y, _, _ = data  # 99 rows: 4 steps an epoch
    trainer = jax_dp.Trainer(2)
    model = dense_bn_model()
    fit = {"global_batch_size": GLOBAL_BATCH, "checkpoint_dir": tmp_path}
    trainer.fit(model, x, y, epochs=2, checkpoint_every_steps=2, **fit)
    assert _lines(capsys.readouterr().out) == []  # a fresh start says nothing

    history = trainer.fit(model, x, y, epochs=2, verbose=2, **fit)
    assert _lines(capsys.readouterr().out) == [
        f"jax_dp: the checkpoint {tmp_path}/step-000002-000000000 is at epoch 2 of 2: nothing to train. "
        "Pass epochs > 2 to train on, or an empty checkpoint_dir to start over."
    ]
    assert history.epoch == [0, 1]  # the finished run's History, as before

    trainer.fit(model, x, y, epochs=2, verbose=0, **fit)
    assert capsys.readouterr().out == ""  # verbose=0 prints nothing, this line included

    shutil.rmtree(tmp_path / "step-000002-000000000")  # the newest left is 2 steps into the second epoch
    assert os.path.isdir(tmp_path / "step-000001-000000002")
    trainer.fit(model, x, y, epochs=3, verbose=2, **fit)
    out = capsys.readouterr().out
    assert _lines(out) == [f"jax_dp: resumed from {tmp_path}/step-000001-000000002 (epoch 2/3, step 2)"]
    assert out.index("jax_dp: resumed from") < out.index("Epoch 2/3")  # before the epoch it resumes


def test_a_list_of_batches_says_what_was_passed_and_what_to_pass(data):
    """``model.fit`` refuses it too ("None is not a valid value for jnp.array"): ours names it and the fix."""
    x, y, _, _ = data
    batches = [(x[:32], y[:32], np.ones(32)), (x[32:], y[32:], np.ones(67))]
    with pytest.raises(
        ValueError, match=r"x is a list of 2 \(x, y, sample_weight\) tuples of arrays: a list of batches"
    ) as raised:
        jax_dp.Trainer(2).fit(dense_bn_model(), batches, epochs=1)
    assert "np.concatenate([b[0] for b in batches])" in str(raised.value)
    assert "keras.utils.PyDataset" in str(raised.value)


def _python(code):
    """``code`` in a fresh interpreter on the CPU, with no forced host devices (XLA_FLAGS unset)."""
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    env.update({"KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=100)


def test_one_cpu_device_says_once_how_to_get_more_replicas():
    lines = ["import jax_dp", "for _ in range(2):", "    trainer = jax_dp.Trainer()", "print(trainer.num_replicas)"]
    code = "\n".join([*lines, "jax_dp.Trainer(1)"])
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1"]
    said = [line for line in result.stderr.splitlines() if "xla_force_host_platform_device_count" in line]
    assert said == [
        "<string>:3: UserWarning: jax_dp: jax sees one CPU device, so Trainer() trains on 1 replica. For N replicas "
        "on a CPU host, start Python with XLA_FLAGS=--xla_force_host_platform_device_count=N (set before jax is "
        "imported; XLA_FLAGS is not set). Pass num_replicas=1 to mean one replica."
    ]  # once, at the caller's line; num_replicas=1 says nothing
