"""Keras's ``compile(steps_per_execution=N)`` (issue 41) on 1 and 2 replicas, against ``model.fit``.

Keras 3.15's torch ``model.fit`` refuses N > 1, and N changes only when the batch hooks are called
and what they see: the weights, History, evaluate and predict values are compared with ``model.fit``
at N = 1 (the same math), and the hook calls with what ``dp_core.keras.Executions`` says Keras makes
of that run's calls (checked against Keras's own loops in dp-core's tests): a group's begin hook with
its first step, its end hook with first + N - 1 and the logs after its last step, predict's with the
group's rows joined. ``test_keras_316_fit_itself`` compares with ``model.fit(steps_per_execution=N)``
where Keras runs it on torch. 99 rows: the last batch is short, and so is the last group.
"""

import re
import shutil
import sys

import cloudpickle
import keras
import numpy as np
import pytest
import torch

import dp_core
import torch_dp
from dp_core.keras import Executions
from torch_dp._loop import epochs as _epochs
from torch_dp._step import steps as _steps

pytestmark = pytest.mark.timeout(300)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # OwnStep travels to the workers by value
CLOSE = {"rtol": 2e-5, "atol": 1e-6}
X = np.random.default_rng(0).normal(size=(99, 3)).astype("float32")
Y = (X[:, :1] - 2 * X[:, 1:2] + 0.5 * X[:, 2:3] * X[:, 0:1]).astype("float32")
VALIDATION = (X[:50], Y[:50])


class Hooks(keras.callbacks.Callback):
    """Every batch hook's call: (hook, batch, logs as floats); predict's end: its outputs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def _add(self, hook, batch, logs):
        self.calls.append((hook, batch, {k: float(v) for k, v in (logs or {}).items()}))

    def on_train_batch_begin(self, batch, logs=None):
        self._add("train_begin", batch, None)

    def on_train_batch_end(self, batch, logs=None):
        self._add("train_end", batch, logs)

    def on_test_batch_begin(self, batch, logs=None):
        self._add("test_begin", batch, None)

    def on_test_batch_end(self, batch, logs=None):
        self._add("test_end", batch, logs)

    def on_predict_batch_begin(self, batch, logs=None):
        self.calls.append(("predict_begin", batch, None))

    def on_predict_batch_end(self, batch, logs=None):
        self.calls.append(("predict_end", batch, np.asarray(logs["outputs"])))


class OwnStep(keras.Model):
    """A model's own train_step and test_step, written as in Keras's guide (its own loss tracker)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(1)
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def call(self, x, training=False):
        return self.out(self.hidden(x))

    @property
    def metrics(self):
        return [self.loss_tracker]

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        loss = keras.ops.mean(keras.ops.square(self(x, training=True) - y))
        loss.backward()
        weights = self.trainable_weights
        with torch.no_grad():
            self.optimizer.apply([w.value.grad for w in weights], weights)
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}

    def test_step(self, data):
        x, y = data
        self.loss_tracker.update_state(keras.ops.mean(keras.ops.abs(self(x) - y)))
        return {"loss": self.loss_tracker.result()}


def model(size, *, own=False, accumulate=None, seed=1):
    keras.utils.set_random_seed(seed)
    if own:
        built = OwnStep()
        built.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), steps_per_execution=size)
        built(X[:2])
        return built
    built = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(0.01, gradient_accumulation_steps=accumulate)
    built.compile(optimizer=optimizer, loss="mse", metrics=["mae"], steps_per_execution=size)
    return built


def grouped(calls, size):
    """The hook calls Keras makes with ``steps_per_execution=size`` where it made ``calls`` with 1:
    a group's begin hook, then its end hook given first + size - 1 and its last step's logs (predict:
    the group's outputs joined), the last group ending where the data ends."""
    executions, expected, outputs = Executions(size), [], []
    for at, (hook, batch, logs) in enumerate(calls):
        phase, kind = hook.split("_")
        if kind == "begin" and executions.first(batch):
            expected.append((hook, batch, None))
        if kind != "end":
            continue
        outputs.append(logs)
        following = calls[at + 1] if at + 1 < len(calls) else None
        data_ends = following is None or following[:2] != (f"{phase}_begin", batch + 1)
        if (batch + 1) % size == 0 or data_ends:
            joined = np.concatenate(outputs) if phase == "predict" else logs
            expected.append((hook, executions.hook_step(batch), joined))
            outputs = []
    return expected


def assert_same_calls(calls, expected):
    assert [call[:2] for call in calls] == [call[:2] for call in expected]
    for (hook, batch, seen), (_, _, wanted) in zip(calls, expected, strict=True):
        if isinstance(wanted, np.ndarray):
            np.testing.assert_allclose(seen, wanted, err_msg=f"{hook} {batch}", **CLOSE)
        elif wanted is not None:
            assert set(seen) == set(wanted)
            for name in wanted:
                np.testing.assert_allclose(seen[name], wanted[name], err_msg=f"{hook} {batch} {name}", **CLOSE)


def assert_same_model(trained, reference):
    for mine, theirs in zip(trained.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, **CLOSE)


def assert_same_history(history, expected):
    assert history.epoch == expected.epoch and set(history.history) == set(expected.history)
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, err_msg=name, **CLOSE)


def keras_run(batch, *, epochs=2, own=False, accumulate=None, **fit):
    """``model.fit``/``evaluate``/``predict`` at N = 1, every hook recorded."""
    reference, hooks = model(1, own=own, accumulate=accumulate), Hooks()
    options = {"batch_size": batch, "verbose": 0, "callbacks": [hooks]}
    history = reference.fit(X, Y, epochs=epochs, shuffle=False, validation_data=VALIDATION, **options, **fit)
    if own:
        return reference, history, None, None, hooks.calls
    evaluated = reference.evaluate(X, Y, **options)
    predicted = reference.predict(X, **options)
    return reference, history, evaluated, predicted, hooks.calls


def check_against_keras(trainer, size, batch, *, with_hooks=True, epochs=2, own=False, accumulate=None, **fit):
    reference, expected_history, evaluated, predicted, calls = keras_run(
        batch, epochs=epochs, own=own, accumulate=accumulate, **fit
    )
    trained, hooks = model(size, own=own, accumulate=accumulate), Hooks()
    options = {"batch_size": batch, "verbose": 0, "callbacks": [hooks] if with_hooks else None}
    history = trainer.fit(trained, X, Y, epochs=epochs, shuffle=False, validation_data=VALIDATION, **options, **fit)
    assert_same_history(history, expected_history)
    assert_same_model(trained, reference)
    assert int(trained.optimizer.iterations) == int(reference.optimizer.iterations)
    if not own:
        np.testing.assert_allclose(trainer.evaluate(trained, X, Y, **options), evaluated, **CLOSE)
        np.testing.assert_allclose(trainer.predict(trained, X, **options), predicted, **CLOSE)
    if with_hooks:
        assert_same_calls(hooks.calls, grouped(calls, size))
    return hooks.calls


@pytest.mark.parametrize("with_hooks", [True, False])
@pytest.mark.parametrize("batch", [32, 10])
@pytest.mark.parametrize("size", [1, 4, 7])
def test_one_replica_equals_model_fit(size, batch, with_hooks):
    calls = check_against_keras(torch_dp.Trainer(num_replicas=1), size, batch, with_hooks=with_hooks)
    if with_hooks and size == 4 and batch == 10:  # what the issue measured on Keras's own loops
        assert [step for _, step, _ in calls[:6]] == [0, 3, 4, 7, 8, 11]


@pytest.mark.multiprocess
@pytest.mark.parametrize("batch", [32, 10])
@pytest.mark.parametrize("size", [1, 4, 7])
def test_two_replicas_equal_model_fit(two_replicas, size, batch):
    calls = check_against_keras(two_replicas, size, batch)
    predicted = [outputs for hook, _, outputs in calls if hook == "predict_end"]
    assert sum(len(outputs) for outputs in predicted) == 99  # every replica's rows, in row order


@pytest.mark.multiprocess
@pytest.mark.parametrize("num_replicas", [1, 2])
def test_steps_per_epoch_reads_whole_groups(two_replicas, num_replicas):
    trainer = two_replicas if num_replicas == 2 else torch_dp.Trainer(num_replicas=1)
    trained, hooks = model(3), Hooks()
    history = trainer.fit(
        trained, X, Y, batch_size=10, epochs=3, steps_per_epoch=5, shuffle=False, verbose=0, callbacks=[hooks]
    )
    # as model.fit reads steps_per_epoch=6 at N = 1: epochs of 6, 4 (the pass of 10 batches ends) and 6 steps
    reference, expected_history, *_, calls = keras_run(10, epochs=3, steps_per_epoch=6)
    calls = [call for call in calls if call[0].startswith("train")]  # no validation in this fit
    assert int(trained.optimizer.iterations) == 16
    assert_same_model(trained, reference)
    np.testing.assert_allclose(history.history["loss"], expected_history.history["loss"], **CLOSE)
    assert [step for hook, step, _ in hooks.calls if hook == "train_end"] == [2, 5, 2, 5, 2, 5]
    assert_same_calls(hooks.calls, grouped(calls, 3))


@pytest.mark.multiprocess
@pytest.mark.parametrize("shard", ["optimizer", "gradients", "full"])
def test_sharded_state(two_replicas, shard):
    two_replicas.shard = shard
    try:
        check_against_keras(two_replicas, 4, 10, epochs=1)
    finally:
        two_replicas.shard = None


@pytest.mark.multiprocess
def test_gradient_accumulation_windows_across_groups(two_replicas):
    check_against_keras(two_replicas, 4, 10, accumulate=3)  # windows of 3 steps, groups of 4


@pytest.mark.multiprocess
def test_a_models_own_train_step(two_replicas):
    check_against_keras(two_replicas, 4, 10, own=True)


def _place(path):
    return tuple(int(n) for n in re.findall(r"\d+", path.name))


@pytest.mark.multiprocess
def test_checkpoints_at_group_ends_resume_bitwise_with_keras_hooks(two_replicas, tmp_path, monkeypatch):
    written, save = [], _epochs.save

    def recorded(writer, model, replica, *, epoch, step, **options):
        written.append((epoch, step))
        return save(writer, model, replica, epoch=epoch, step=step, **options)

    monkeypatch.setattr(_epochs, "save", recorded)  # rank 0's, in this process (the epochs' own: step 0)
    fit = {"batch_size": 10, "epochs": 2, "shuffle": False, "verbose": 0, "checkpoint_every_steps": 3}
    whole, hooks = model(2), Hooks()
    history = two_replicas.fit(whole, X, Y, checkpoint_dir=str(tmp_path / "whole"), callbacks=[hooks], **fit)
    *_, calls = keras_run(10, epochs=2)
    assert_same_calls(hooks.calls, grouped([c for c in calls if c[0].startswith("train")], 2))
    # steps 3, 6 and 9 are due: written at the ends of the groups holding them (4, 6; 9's group ends the epoch)
    assert written == [(0, 4), (0, 6), (1, 4), (1, 6)]
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole", resumed_dir)
    for path in dp_core.list_checkpoints(resumed_dir):
        if _place(path) > (1, 4):
            shutil.rmtree(path)
    resumed, resumed_hooks = model(2, seed=7), Hooks()
    resumed_history = two_replicas.fit(resumed, X, Y, checkpoint_dir=str(resumed_dir), callbacks=[resumed_hooks], **fit)
    for mine, theirs in zip(resumed.get_weights(), whole.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)  # bitwise
    assert_same_history(resumed_history, history)
    at = hooks.calls.index(("train_begin", 4, {}), len(hooks.calls) // 2)  # epoch 1's group from step 4
    assert_same_calls(resumed_hooks.calls, hooks.calls[at:])


class _Counted:
    def __init__(self, monkeypatch, module, name):
        self.count, original = 0, getattr(module, name)

        def counting(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)


@pytest.mark.multiprocess
@pytest.mark.parametrize("own", [False, True])
def test_inside_a_group_nothing_meets_the_host(two_replicas, monkeypatch, own):
    """Rank 0 (this process) per epoch of 10 steps in groups of 4, a callback acting at every batch:
    rank 0's decisions travel once a group (on its first step's all-reduce, or broadcast before it for a
    model's own step), the logs are read once a group."""
    decisions = _Counted(monkeypatch, _steps, "decisions_on_device")
    broadcasts = _Counted(monkeypatch, _epochs, "share_decisions")
    reads = _Counted(monkeypatch, _epochs, "logs_of")
    hooks = Hooks()
    two_replicas.fit(model(4, own=own), X, Y, batch_size=10, epochs=1, shuffle=False, verbose=0, callbacks=[hooks])
    assert [step for hook, step, _ in hooks.calls] == [0, 3, 4, 7, 8, 11]
    if own:  # broadcast before a group's first step
        assert (broadcasts.count, decisions.count) == (3, 0)
    else:  # on the first step's all-reduce; the metric states on the last's, read once
        assert (decisions.count, reads.count, broadcasts.count) == (3, 3, 0)


@pytest.mark.skipif(
    tuple(int(part) for part in keras.version().split(".")[:2]) < (3, 16),
    reason="Keras runs steps_per_execution on torch from 3.16",
)
@pytest.mark.parametrize("size", [4, 7])
def test_keras_316_fit_itself(size):
    """Against ``model.fit(steps_per_execution=N)`` itself, where Keras runs it on torch."""
    runs = {}
    for name in ("keras", "torch_dp"):
        trained, hooks = model(size), Hooks()
        options = {"batch_size": 10, "verbose": 0, "callbacks": [hooks]}
        if name == "keras":
            history = trained.fit(X, Y, epochs=2, shuffle=False, validation_data=VALIDATION, **options)
            evaluated, predicted = trained.evaluate(X, Y, **options), trained.predict(X, **options)
        else:
            trainer = torch_dp.Trainer(num_replicas=1)
            history = trainer.fit(trained, X, Y, epochs=2, shuffle=False, validation_data=VALIDATION, **options)
            evaluated, predicted = trainer.evaluate(trained, X, Y, **options), trainer.predict(trained, X, **options)
        runs[name] = trained, history, evaluated, predicted, hooks.calls
    (reference, expected_history, expected_evaluated, expected_predicted, calls) = runs["keras"]
    trained, history, evaluated, predicted, seen = runs["torch_dp"]
    for mine, theirs in zip(trained.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    assert_same_history(history, expected_history)
    np.testing.assert_allclose(evaluated, expected_evaluated, **CLOSE)
    np.testing.assert_array_equal(predicted, expected_predicted)
    assert_same_calls(seen, calls)
