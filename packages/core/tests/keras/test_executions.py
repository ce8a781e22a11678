"""``Executions`` says what Keras's own loops do with ``steps_per_execution``: checked against
``model.fit``/``evaluate``/``predict`` themselves, and against a fit's arguments."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from dp_core.keras import CallChecks, Executions, Inputs, checked_call, concatenated, fit_arguments

ROWS, BATCH = 99, 10  # 10 batches, the last one short


class Hooks(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def on_train_batch_begin(self, batch, logs=None):
        self.calls.append(("begin", batch))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("end", batch))

    def on_test_batch_begin(self, batch, logs=None):
        self.calls.append(("begin", batch))

    def on_test_batch_end(self, batch, logs=None):
        self.calls.append(("end", batch))

    def on_predict_batch_end(self, batch, logs=None):
        self.calls.append(("rows", len(logs["outputs"])))


def predicted_hooks(executions: Executions, steps: int) -> list[tuple[str, int]]:
    """The hook calls ``Executions`` says an epoch of ``steps`` makes."""
    calls = []
    for step in range(steps):
        if executions.first(step):
            calls.append(("begin", step))
        if executions.last(step, steps):
            calls.append(("end", executions.hook_step(step)))
    return calls


def data() -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(0).normal(size=(ROWS, 3)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def model(size: int) -> keras.Model:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=size)
    return model


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="Keras 3.15 runs steps_per_execution on jax only")
@pytest.mark.parametrize("size", [1, 3, 4, 7, 12])
def test_the_hooks_are_keras_s_for_every_group_size(size):
    x, y = data()
    hooks, trained = Hooks(), model(size)
    trained.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[hooks])
    assert hooks.calls == predicted_hooks(Executions(size), 10)
    assert int(trained.optimizer.iterations) == 10
    hooks.calls.clear()
    trained.evaluate(x, y, batch_size=BATCH, verbose=0, callbacks=[hooks])
    assert hooks.calls == predicted_hooks(Executions(size), 10)
    hooks.calls.clear()
    trained.predict(x, batch_size=BATCH, verbose=0, callbacks=[hooks])
    groups = range(0, 10, size)  # a group's rows: its batches', the last one 9 rows
    assert hooks.calls == [("rows", min((first + size) * BATCH, ROWS) - first * BATCH) for first in groups]


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="Keras 3.15 runs steps_per_execution on jax only")
def test_steps_per_epoch_reads_whole_groups_as_fit_arguments_say():
    x, y = data()
    trained = model(3)
    trained.fit(x, y, batch_size=BATCH, epochs=3, steps_per_epoch=5, verbose=0, shuffle=False)
    arguments = fit_arguments(
        Inputs(x, y), global_batch_size=BATCH, num_replicas=2, epochs=3, steps_per_epoch=5, executions=Executions(3)
    )
    epochs = [arguments.steps_in(epoch) for epoch in range(3)]
    assert epochs == [6, 4, 6]  # 6 a group-rounded epoch; the pass of 10 batches ends after 4 more
    assert int(trained.optimizer.iterations) == sum(epochs)
    assert arguments.steps_shown == 5  # the progress bar's target, as model.fit's


def test_a_checkpoint_is_due_at_the_end_of_the_group_holding_its_step():
    executions = Executions(4)
    every_6 = lambda done, steps: done % 6 == 0  # noqa: E731
    assert [done for done in (4, 8, 12, 16) if executions.checkpoint_due(every_6, done, None)] == [8, 12]
    assert not executions.checkpoint_due(every_6, 14, 14)  # the epoch's end: its own checkpoint follows
    assert Executions(1).checkpoint_due(every_6, 6, None) and not Executions(1).checkpoint_due(every_6, 5, None)


def test_a_groups_predictions_are_joined_on_rows():
    outputs = [{"a": np.zeros((2, 1)), "b": np.ones((2,))}, {"a": np.ones((1, 1)), "b": np.zeros((1,))}]
    joined = concatenated(outputs)
    assert joined["a"].tolist() == [[0.0], [0.0], [1.0]] and joined["b"].tolist() == [1.0, 1.0, 0.0]
    assert concatenated(outputs[:1]) is outputs[0]


class Batches(keras.utils.PyDataset):
    def __len__(self):
        return 10

    def __getitem__(self, index):
        x, y = data()
        return x[index * BATCH : (index + 1) * BATCH], y[index * BATCH : (index + 1) * BATCH]


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="Keras 3.15 runs steps_per_execution on jax only")
def test_a_sources_steps_are_read_in_whole_groups_as_keras_s_evaluate_reads_them():
    hooks, trained = Hooks(), model(3)
    trained.evaluate(Batches(), steps=5, verbose=0, callbacks=[hooks])
    assert hooks.calls == predicted_hooks(Executions(3), 6)  # 6 batches read: begin 0, end 2, begin 3, end 5
    checks = CallChecks(backend=keras.backend.backend(), package="a_dp", num_replicas=2)
    call = checked_call(
        trained, Batches(), batch_size=None, global_batch_size=None, checks=checks, step_names=("test_step",), steps=5
    )
    assert call.inputs.num_batches == 6 and call.executions == Executions(3)
