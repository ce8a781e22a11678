"""``compile(steps_per_execution=N)`` (issue 41) against Keras's own jax loops in this process.

99 rows: global batch 32 is 4 batches (the last 3 rows, padded on the mesh), batch 10 is 10
batches (the last 9 rows). Keras calls the batch hooks once per group of N steps: the begin hook
with the group's first step, the end hook with ``first + N - 1`` (even for a shorter last group)
and the logs after its last step; the numbers (weights, History, evaluate, predict) are N=1's.
A whole group of same-shaped batches runs on the mesh as one ``jax.lax.scan`` (``_step.scan``).
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import keras
import numpy as np
import pytest
from jax_dp_helpers import assert_history_close, assert_weights_close

import dp_core
import jax_dp
from jax_dp._step.steps import Steps

NUM_SAMPLES = 99
REPLICAS = {32: 4, 10: 2}  # global batch size -> replicas that divide it


def rows(num_samples: int = NUM_SAMPLES, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    draw = np.random.default_rng(seed)
    x = draw.normal(size=(num_samples, 5)).astype("float32")
    return x, (x @ draw.normal(size=(5, 1)) + 0.1 * draw.normal(size=(num_samples, 1))).astype("float32")


def build(steps_per_execution: int, *, hidden: int = 8, accumulate: int | None = None) -> keras.Model:
    keras.utils.set_random_seed(1)
    layers = [keras.layers.Dense(hidden, activation="relu") for _ in range(2 if hidden > 8 else 1)]
    model = keras.Sequential([keras.Input((5,)), *layers, keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(0.01, gradient_accumulation_steps=accumulate)
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"], steps_per_execution=steps_per_execution)
    return model


class Hooks(keras.callbacks.Callback):
    """Every batch hook's call: ``calls`` the hook and its step, ``logs`` what each end hook got."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, ...]] = []
        self.logs: list[dict[str, Any]] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(("epoch", epoch))

    def on_train_batch_begin(self, batch, logs=None):
        self.calls.append(("train_begin", batch))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("train_end", batch))
        self.logs.append(dict(logs or {}))

    def on_test_batch_begin(self, batch, logs=None):
        self.calls.append(("test_begin", batch))

    def on_test_batch_end(self, batch, logs=None):
        self.calls.append(("test_end", batch))
        self.logs.append(dict(logs or {}))

    def on_predict_batch_begin(self, batch, logs=None):
        self.calls.append(("predict_begin", batch))

    def on_predict_batch_end(self, batch, logs=None):
        self.calls.append(("predict_end", batch))
        self.logs.append({"outputs": np.asarray((logs or {})["outputs"])})


def assert_same_hooks(expected: Hooks, actual: Hooks) -> None:
    assert actual.calls == expected.calls
    assert len(actual.logs) == len(expected.logs)
    for want, got in zip(expected.logs, actual.logs, strict=True):
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def twins(steps_per_execution: int, **options: Any) -> tuple[keras.Model, keras.Model]:
    return build(steps_per_execution, **options), build(steps_per_execution, **options)


@pytest.mark.parametrize("hooks", [True, False], ids=["batch-hooks", "progress-only"])
@pytest.mark.parametrize("global_batch", [32, 10])
@pytest.mark.parametrize("steps_per_execution", [1, 4, 7])
def test_fit_with_validation_is_model_fit(steps_per_execution, global_batch, hooks):
    x, y = rows()
    x_val, y_val = rows(37, seed=1)
    expected, actual = twins(steps_per_execution)
    want_hooks, got_hooks = Hooks(), Hooks()
    options = {"epochs": 2, "shuffle": False, "verbose": 0, "validation_data": (x_val, y_val)}
    want = expected.fit(x, y, batch_size=global_batch, callbacks=[want_hooks] if hooks else [], **options)

    trainer = jax_dp.Trainer(REPLICAS[global_batch])
    got = trainer.fit(actual, x, y, global_batch_size=global_batch, callbacks=[got_hooks] if hooks else [], **options)

    assert_weights_close(expected, actual)
    assert_history_close(want.history, got.history)
    assert_same_hooks(want_hooks, got_hooks)
    if hooks and steps_per_execution == 4 and global_batch == 10:  # the calls Keras makes, written out
        assert [step for hook, step in got_hooks.calls[:7] if hook.startswith("train")] == [0, 3, 4, 7, 8, 11]


@pytest.mark.parametrize(("steps_per_execution", "global_batch"), [(2, 32), (7, 32), (4, 10)])
def test_evaluate_and_predict_are_keras_s(steps_per_execution, global_batch):
    x, y = rows()
    expected, actual = twins(steps_per_execution)
    trainer = jax_dp.Trainer(REPLICAS[global_batch])
    want_hooks, got_hooks = Hooks(), Hooks()

    want = expected.evaluate(x, y, batch_size=global_batch, callbacks=[want_hooks], verbose=0, return_dict=True)
    got = trainer.evaluate(actual, x, y, global_batch_size=global_batch, callbacks=[got_hooks], return_dict=True)
    want_outputs = expected.predict(x, batch_size=global_batch, callbacks=[want_hooks], verbose=0)
    got_outputs = trainer.predict(actual, x, global_batch_size=global_batch, callbacks=[got_hooks], verbose=0)

    assert_history_close(want, got)
    np.testing.assert_allclose(got_outputs, want_outputs, rtol=1e-5, atol=1e-6)
    assert_same_hooks(want_hooks, got_hooks)
    if (steps_per_execution, global_batch) == (2, 32):  # a group's outputs, joined: 64 rows, then 35
        assert [len(logs["outputs"]) for logs in got_hooks.logs[-2:]] == [64, 35]
        assert got_hooks.calls[-4:] == [
            ("predict_begin", 0),
            ("predict_end", 1),
            ("predict_begin", 2),
            ("predict_end", 3),
        ]


def test_steps_per_epoch_reads_whole_groups_as_model_fit():
    x, y = rows()
    expected, actual = twins(3)
    want_hooks, got_hooks = Hooks(), Hooks()
    options = {"epochs": 3, "shuffle": False, "verbose": 0, "steps_per_epoch": 5}
    want = expected.fit(x, y, batch_size=10, callbacks=[want_hooks], **options)

    got = jax_dp.Trainer(2).fit(actual, x, y, global_batch_size=10, callbacks=[got_hooks], **options)

    assert_weights_close(expected, actual)
    assert_history_close(want.history, got.history)
    assert_same_hooks(want_hooks, got_hooks)
    assert int(actual.optimizer.iterations.numpy()) == 6 + 4 + 6  # whole groups, as far as the data goes


@pytest.mark.parametrize("shard", [None, "optimizer", "gradients", "full"])
def test_sharded_state_trains_as_model_fit(shard):
    # 4 batches of 32 are one whole group of 4 (the last padded): one scanned program per epoch
    x, y = rows()
    expected, actual = twins(4, hidden=128)  # a 128 x 128 kernel: 2**14 elements, split by every mode
    want_hooks, got_hooks = Hooks(), Hooks()
    want = expected.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[want_hooks])

    trainer = jax_dp.Trainer(4, shard=shard)
    got = trainer.fit(actual, x, y, global_batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[got_hooks])

    assert_weights_close(expected, actual, atol=2e-5)
    assert_history_close(want.history, got.history)
    assert_same_hooks(want_hooks, got_hooks)


def test_accumulated_gradients_train_as_model_fit():
    x, y = rows()
    expected, actual = twins(4, accumulate=2)
    want_hooks, got_hooks = Hooks(), Hooks()
    want = expected.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0, callbacks=[want_hooks])

    got = jax_dp.Trainer(2).fit(
        actual, x, y, global_batch_size=10, epochs=2, shuffle=False, verbose=0, callbacks=[got_hooks],
        accumulate_steps=2,
    )  # fmt: skip

    assert_weights_close(expected, actual)
    assert_history_close(want.history, got.history)
    assert_same_hooks(want_hooks, got_hooks)


class StopAt(keras.callbacks.Callback):
    """Interrupts a fit as a crash would, before one step of one epoch."""

    def __init__(self, epoch: int, step: int) -> None:
        super().__init__()
        self.at, self.epoch = (epoch, step), -1

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise KeyboardInterrupt


def test_a_checkpoint_lands_at_the_end_of_the_group_holding_its_step_and_resumes_bitwise(tmp_path):
    x, y = rows()
    keras_model, uninterrupted = twins(2)
    keras_hooks = Hooks()
    keras_model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0, callbacks=[keras_hooks])
    options = {"global_batch_size": 10, "epochs": 2, "shuffle": False, "verbose": 0, "checkpoint_every_steps": 3}
    jax_dp.Trainer(2).fit(uninterrupted, x, y, checkpoint_dir=str(tmp_path / "whole"), **options)

    interrupted = build(2)
    with pytest.raises(KeyboardInterrupt):
        jax_dp.Trainer(2).fit(
            interrupted, x, y, checkpoint_dir=str(tmp_path / "cut"), callbacks=[StopAt(1, 8)], **options
        )
    # due after steps 3 and 6: written at the ends of the groups [2, 3] and [6, 7]... of epoch 1, [4, 5]
    written = [path.name for path in dp_core.list_checkpoints(tmp_path / "cut")]
    assert written[-3:] == ["step-000001-000000000", "step-000001-000000004", "step-000001-000000006"], written
    resumed, resumed_hooks = build(2), Hooks()
    jax_dp.Trainer(2).fit(resumed, x, y, checkpoint_dir=str(tmp_path / "cut"), callbacks=[resumed_hooks], **options)

    for got, want in zip(resumed.get_weights(), uninterrupted.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)  # bitwise
    assert_weights_close(keras_model, resumed)
    epoch_1 = keras_hooks.calls.index(("epoch", 1))
    # the resumed epoch begins with the group of step 6, its hooks where Keras calls them
    resumed_calls = [call for call in keras_hooks.calls[epoch_1 + 1 :] if call[0] != "train_begin" or call[1] >= 6]
    resumed_calls = [call for call in resumed_calls if call[0] != "train_end" or call[1] >= 7]
    assert resumed_hooks.calls == [("epoch", 1), *resumed_calls]


class OwnTrainStep(keras.Model):
    """One Dense layer trained by its own (jax, stateless) step; a Mean tracker of the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.loss_tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self) -> list[keras.metrics.Metric]:
        return [self.loss_tracker]

    def call(self, x: Any) -> Any:
        return self.dense(x)

    def train_step(self, state: Any, data: Any) -> tuple[dict[str, Any], Any]:
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data

        def loss_of(values: list[Any]) -> Any:
            y_pred, _ = self.stateless_call(values, non_trainable, x)
            return keras.ops.mean(keras.ops.square(y - y_pred))

        loss, grads = jax.value_and_grad(loss_of)(trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
        metrics_variables = self.loss_tracker.stateless_update_state(metrics_variables, loss)
        logs = {"loss": self.loss_tracker.stateless_result(metrics_variables)}
        return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)


def own_train_step_model() -> OwnTrainStep:
    keras.utils.set_random_seed(4)
    model = OwnTrainStep()
    model.build((None, 5))
    model.compile(optimizer=keras.optimizers.Adam(0.02), steps_per_execution=3)
    return model


def test_a_model_s_own_train_step_runs_in_groups_as_model_fit():
    x, y = rows()
    expected, actual = own_train_step_model(), own_train_step_model()
    want_hooks, got_hooks = Hooks(), Hooks()
    want = expected.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0, callbacks=[want_hooks])

    got = jax_dp.Trainer(2).fit(
        actual, x, y, global_batch_size=10, epochs=2, shuffle=False, verbose=0, callbacks=[got_hooks]
    )

    assert_weights_close(expected, actual)
    assert_history_close(want.history, got.history)
    assert_same_hooks(want_hooks, got_hooks)


def test_a_whole_group_is_one_dispatch_of_one_program(monkeypatch):
    calls: collections.Counter[str] = collections.Counter()
    lowered: dict[str, str] = {}
    original = Steps.__init__

    def counting(self: Steps, fetch: Any) -> None:
        def counted_fetch(kind: str) -> Any:
            step = fetch(kind)

            def call(*arguments: Any) -> Any:
                calls[kind] += 1
                if kind in ("train_scanned", "train") and kind not in lowered:  # before the call: state donated
                    shapes = jax.tree.map(
                        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), arguments[:2]
                    )
                    lowered[kind] = step.lower(*shapes, arguments[2]).as_text()
                return step(*arguments)

            return call

        original(self, counted_fetch)

    monkeypatch.setattr(Steps, "__init__", counting)
    x, y = rows()
    model = build(4)
    jax_dp.Trainer(2).fit(model, x, y, global_batch_size=10, epochs=2, shuffle=False, verbose=0)

    # 10 batches an epoch: steps 0-3 and 4-7 one scanned program each, the short last group 8-9 step by step
    assert calls["train_scanned"] == 2 * 2
    assert calls["train"] == 2 * 2
    # one program holds the group's 4 steps: on CPU written out (a loop there runs convolutions
    # slowly), so it holds 4 times the matrix products of one step
    program, one_step = lowered["train_scanned"], lowered["train"]
    assert "stablehlo.while" not in program
    assert program.count("stablehlo.dot_general") == 4 * one_step.count("stablehlo.dot_general") > 0
    assert int(model.optimizer.iterations.numpy()) == 20


def test_a_model_s_own_test_and_predict_steps_run_in_groups_as_keras():
    from test_custom_steps import own_predict_step_model, own_test_step_model  # the models those tests use

    x, y = rows()
    evaluated, predicted = [own_test_step_model(), own_test_step_model()], [own_predict_step_model() for _ in "ab"]
    for model in evaluated:
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"], steps_per_execution=3)
    for model in predicted:
        model.compile(steps_per_execution=3)
    predicted[1].set_weights(predicted[0].get_weights())
    want_hooks, got_hooks = Hooks(), Hooks()
    trainer = jax_dp.Trainer(2)

    want = evaluated[0].evaluate(x, y, batch_size=10, callbacks=[want_hooks], verbose=0, return_dict=True)
    got = trainer.evaluate(evaluated[1], x, y, global_batch_size=10, callbacks=[got_hooks], return_dict=True)
    want_outputs = predicted[0].predict(x, batch_size=10, verbose=0)
    got_outputs = trainer.predict(predicted[1], x, global_batch_size=10, verbose=0)

    assert_history_close(want, got)
    assert_same_hooks(want_hooks, got_hooks)
    assert [step for _, step in got_hooks.calls] == [0, 2, 3, 5, 6, 8, 9, 11]
    for name in want_outputs:
        np.testing.assert_allclose(got_outputs[name], want_outputs[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert float(predicted[1].batches.numpy()) == float(predicted[0].batches.numpy()) == 10.0
