"""Gradient accumulation on two gloo replicas: one gradient all-reduce per window, the updates,
History and optimizer state of single-device ``model.fit`` with the same optimizer."""

import os
import signal

import keras
import numpy as np
import pytest
import torch
import torch_dp_testing as testing

import dp_core
import torch_dp
from dp_core.keras import internals

ops = keras.ops

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

GLOBAL_BATCH_SIZE = 24  # 99 samples: 5 steps an epoch, the last of 3 rows (rank 1 gets none of them)
EPOCHS = 3  # 15 steps: windows of 2, 3 or 4 steps cross the epochs' ends, and the last is left open


@pytest.fixture
def trainer(two_replicas):
    return two_replicas  # the run's replicas (conftest.py)


def _model(optimizer: str, steps: int, seed: int = 0) -> keras.Model:
    model = testing.dense_batchnorm_model(seed=seed)
    if optimizer == "sgd":
        chosen = keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=steps)
    else:
        chosen = keras.optimizers.Adam(0.01, gradient_accumulation_steps=steps)
    model.compile(optimizer=chosen, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _keras_reference(optimizer: str, steps: int, epochs: int = EPOCHS):
    """Single-device ``model.fit`` from the same weights, and those weights."""
    x, y = testing.data()
    reference = _model(optimizer, steps)
    start = reference.get_weights()
    history = reference.fit(x, y, batch_size=GLOBAL_BATCH_SIZE, epochs=epochs, shuffle=False, verbose=0)
    return reference, start, history


def _assert_like_keras(model, history, reference, expected):
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)  # BatchNorm moving statistics included
    assert history.epoch == expected.epoch
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, atol=1e-6, err_msg=name)
    # the optimizer as one device leaves it: its count, and the open window's gradient sums
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations)
    assert int(internals.apply_count(model.optimizer)) == int(internals.apply_count(reference.optimizer))
    for mine, theirs in zip(model.optimizer.variables, reference.optimizer.variables, strict=True):
        np.testing.assert_allclose(
            ops.convert_to_numpy(mine), ops.convert_to_numpy(theirs), atol=1e-5, err_msg=mine.path
        )


class _GradientAllReduces:
    """Counts this process's (rank 0's) sums over replicas of at least ``size`` elements: gradients,
    not the BatchNorm moments, flags or metric states that travel in small ones. A small sum is an
    all-gather (``_comm.sum_in_place``), a large one an all-reduce: both are counted."""

    def __init__(self, size: int) -> None:
        self.size, self.count = size, 0
        self._all_reduce = torch.distributed.all_reduce
        self._all_gather = torch.distributed.all_gather

    def all_reduce(self, tensor, *args, **kwargs):
        self.count += tensor.numel() >= self.size
        return self._all_reduce(tensor, *args, **kwargs)

    def all_gather(self, parts, tensor, *args, **kwargs):
        self.count += tensor.numel() >= self.size
        return self._all_gather(parts, tensor, *args, **kwargs)

    def install(self, patch: pytest.MonkeyPatch) -> None:
        patch.setattr(torch.distributed, "all_reduce", self.all_reduce)
        patch.setattr(torch.distributed, "all_gather", self.all_gather)


_fits: dict[tuple[str, int], tuple] = {}


def _fit_counting(trainer, optimizer: str, steps: int, monkeypatch):
    """``fit`` on 2 replicas from the reference's start, counting gradient all-reduces (once per
    (optimizer, steps): the exactness and the count tests share the run)."""
    if (optimizer, steps) not in _fits:
        reference, start, expected = _keras_reference(optimizer, steps)
        model = _model(optimizer, steps, seed=1)
        model.set_weights(start)
        counter = _GradientAllReduces(sum(int(np.prod(v.shape)) for v in model.trainable_weights))
        with monkeypatch.context() as patched:
            counter.install(patched)
            x, y = testing.data()
            history = trainer.fit(
                model, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=EPOCHS, shuffle=False, verbose=0
            )
        _fits[optimizer, steps] = (model, history, reference, expected, counter.count)
    return _fits[optimizer, steps]


@pytest.mark.parametrize(("optimizer", "steps"), [("sgd", 2), ("adam", 4)])
def test_accumulated_fit_equals_keras_on_one_device(trainer, optimizer, steps, monkeypatch):
    model, history, reference, expected, _ = _fit_counting(trainer, optimizer, steps, monkeypatch)
    _assert_like_keras(model, history, reference, expected)


@pytest.mark.parametrize(("optimizer", "steps"), [("sgd", 2), ("adam", 4)])
def test_gradients_travel_once_per_window(trainer, optimizer, steps, monkeypatch):
    *_, count = _fit_counting(trainer, optimizer, steps, monkeypatch)
    micro_steps = EPOCHS * 5
    # one all-reduce at each window's last step, and one at the end of fit for the open window
    assert count == micro_steps // steps + 1 < micro_steps


def test_checkpoint_mid_window_resumes_as_uninterrupted(trainer, tmp_path):
    """Checkpoints every 2 steps with windows of 3: the one at epoch 1, step 2 holds one step
    of an open window. A fresh model resumed from it trains on as Keras does, uninterrupted."""
    reference, start, expected = _keras_reference("sgd", 3)
    x, y = testing.data()
    first = _model("sgd", 3, seed=1)
    first.set_weights(start)
    arguments = dict(global_batch_size=GLOBAL_BATCH_SIZE, shuffle=False, verbose=0, checkpoint_dir=str(tmp_path))
    trainer.fit(first, x, y, epochs=2, checkpoint_every_steps=2, **arguments)
    names = [path.name for path in dp_core.list_checkpoints(tmp_path)]
    assert names == ["step-000001-000000002", "step-000001-000000004", "step-000002-000000000"]
    for later in names[1:]:  # as if the run had stopped after epoch 1, step 2
        for file in (tmp_path / later).iterdir():
            file.unlink()
        (tmp_path / later).rmdir()
    saved = dp_core.latest_checkpoint(tmp_path)
    assert (saved.epoch, saved.step) == (1, 2)  # 7 steps: one into the window of steps 6 to 8

    resumed = _model("sgd", 3, seed=2)
    history = trainer.fit(resumed, x, y, epochs=EPOCHS, **arguments)
    _assert_like_keras(resumed, history, reference, expected)


def test_a_stop_mid_window_leaves_its_steps_accumulated_as_keras_does(trainer, monkeypatch):
    """A batch-level callback (every step's logs, summed without the gradients) stops after
    epoch 1, step 1: 7 steps, the last window open by one step, as in ``model.fit``."""
    x, y = testing.data()
    reference = _model("sgd", 3)
    start = reference.get_weights()
    expected = reference.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH_SIZE,
        epochs=EPOCHS,
        shuffle=False,
        callbacks=[testing.StopAtBatch(1, epoch=1)],
        verbose=0,
    )
    model = _model("sgd", 3, seed=1)
    model.set_weights(start)
    counter = _GradientAllReduces(sum(int(np.prod(v.shape)) for v in model.trainable_weights))
    counter.install(monkeypatch)
    history = trainer.fit(
        model,
        x,
        y,
        global_batch_size=GLOBAL_BATCH_SIZE,
        epochs=EPOCHS,
        shuffle=False,
        callbacks=[testing.StopAtBatch(1, epoch=1)],
        verbose=0,
    )
    _assert_like_keras(model, history, reference, expected)
    assert int(internals.apply_count(model.optimizer)) == 7
    assert counter.count == 7 // 3 + 1  # two windows' ends, and the open one summed at the end


def _fit_with_nan(trainer):
    x, y = testing.data()
    x[40] = np.nan  # global batch 1 of every epoch, in rank 1's half of it
    model = _model("adam", 2)
    with pytest.warns(RuntimeWarning, match=r"skipped that step's update on every replica") as warned:
        history = trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=EPOCHS, shuffle=False, verbose=0)
    return model, history, [str(w.message) for w in warned if "Non-finite" in str(w.message)]


def test_skip_leaves_the_whole_window_out_on_every_replica(trainer, monkeypatch):
    """A NaN row in step 1 of every epoch: the windows holding it are left out (their steps are
    not counted, so the next two steps make a whole window), the same on one replica and two."""
    monkeypatch.setattr(trainer, "on_nonfinite_loss", "skip")
    model, history, warnings = _fit_with_nan(trainer)
    expected, expected_history, expected_warnings = _fit_with_nan(
        torch_dp.Trainer(num_replicas=1, on_nonfinite_loss="skip")
    )
    # epoch 0: steps 0-1 left out, 2-3 applied, 4 + epoch 1's 0 applied, 1-2 left out, 3-4 applied;
    # epoch 2: 0-1 left out, 2-3 applied, 4 open: 9 steps counted, not 15 - 3 as without windows
    assert int(internals.apply_count(model.optimizer)) == int(internals.apply_count(expected.optimizer)) == 9
    assert warnings == expected_warnings and len(warnings) == 3
    assert "epoch 0, step 1" in warnings[0] and "epoch 1, step 2" in warnings[1]
    assert np.isfinite(history.history["loss"]).all()
    for mine, theirs in zip(model.get_weights(), expected.get_weights(), strict=True):
        assert np.isfinite(mine).all()
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    np.testing.assert_allclose(history.history["loss"], expected_history.history["loss"], rtol=1e-5)


class _PreemptAfterEpoch(keras.callbacks.Callback):
    """Sends SIGUSR1 to this process (rank 0) at the end of epoch 0, if a preemption watch
    catches it there (otherwise it would end the test run)."""

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0 and signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, signal.SIG_IGN, None):
            os.kill(os.getpid(), signal.SIGUSR1)


def test_a_preemption_waits_for_the_window_end_and_resumes_as_uninterrupted(trainer, tmp_path):
    """Windows of 4, no batch-level callback: a notice after epoch 0 (5 steps) travels with the
    all-reduce of the window of steps 4 to 7, at epoch 1, step 2; that step is undone and the
    checkpoint holds the window's 3 steps before it, summed. A resumed fit trains on as Keras does."""
    reference, start, expected = _keras_reference("sgd", 4)
    x, y = testing.data()
    first = _model("sgd", 4, seed=1)
    first.set_weights(start)
    arguments = dict(global_batch_size=GLOBAL_BATCH_SIZE, shuffle=False, verbose=0, checkpoint_dir=str(tmp_path))
    with pytest.raises(dp_core.Preempted) as raised:
        trainer.fit(first, x, y, epochs=EPOCHS, callbacks=[_PreemptAfterEpoch()], **arguments)
    assert (raised.value.epoch, raised.value.step) == (1, 2)
    saved = dp_core.latest_checkpoint(tmp_path)
    assert (saved.epoch, saved.step) == (1, 2)

    resumed = _model("sgd", 4, seed=2)
    history = trainer.fit(resumed, x, y, epochs=EPOCHS, **arguments)
    _assert_like_keras(resumed, history, reference, expected)
