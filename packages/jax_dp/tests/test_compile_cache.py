"""The compile cache: a Trainer's later fit/evaluate/predict calls with the same model and shapes
trace and compile nothing, and every change to what a step was traced from compiles again,
giving what a fresh Trainer (no cache) computes."""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import itertools
import weakref
from collections.abc import Callable, Iterator

import jax
import keras
import numpy as np
import optax
import pytest
from jax_dp_helpers import GLOBAL_BATCH, assert_history_close, assert_weights_close

import dp_core
import jax_dp

pytestmark = pytest.mark.timeout(300)

TRACES: collections.Counter[str] = collections.Counter()
_names = itertools.count()


class CountsTraces(keras.layers.Layer):
    """An identity layer counting its calls: once per trace of a step (and per symbolic build)."""

    def call(self, inputs):
        TRACES[self.name] += 1
        return inputs


def traces(model: keras.Model) -> int:
    return sum(TRACES[layer.name] for layer in model.layers if isinstance(layer, CountsTraces))


@contextlib.contextmanager
def backend_compiles() -> Iterator[list[str]]:
    """The names of the programs XLA compiles within the block, and one entry per program read from
    the persistent compile cache (the suite turns it on, conftest.py): a program asked for again."""
    names: list[str] = []

    def listen(event: str, duration: float, **metadata: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(str(metadata.get("fun_name")))
        elif event == "/jax/compilation_cache/cache_retrieval_time_sec":
            names.append("(read from the persistent compile cache)")

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def build(optimizer: keras.optimizers.Optimizer | None = None, *, batch_norm: bool = False) -> keras.Model:
    """Dense(5) -> Dense(5) [-> BatchNormalization without center/scale] -> Dense(1), same weights each time."""
    keras.utils.set_random_seed(5)
    layers = [
        keras.Input((5,)),
        keras.layers.Dense(5, name="first"),
        keras.layers.Dense(5, name="second"),
        CountsTraces(name=f"counts_traces_{next(_names)}"),
    ]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization(center=False, scale=False, name="norm"))
    model = keras.Sequential([*layers, keras.layers.Dense(1, name="last")])
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model


class LogsOnly(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(logs["loss"])


def test_second_calls_with_the_same_shapes_trace_and_compile_nothing(data):
    x, y, x_val, y_val = data
    trainer = jax_dp.Trainer(2)
    model, other = build(), build()

    def calls(model: keras.Model) -> None:
        trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, validation_data=(x_val, y_val), verbose=0)
        trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, callbacks=[LogsOnly()], warmup_steps=2, verbose=0)
        trainer.evaluate(model, x_val, y_val, global_batch_size=GLOBAL_BATCH, verbose=0)
        trainer.predict(model, x, global_batch_size=GLOBAL_BATCH, verbose=0)

    calls(model)
    calls(other)  # another model gets steps of its own, and leaves the first one's in place
    traced = traces(model)
    assert traced >= 4  # train, train with logs, test, predict: each traced at least once

    with backend_compiles() as compiled:
        calls(model)
    assert (traces(model), compiled) == (traced, [])


def test_new_batch_shapes_trace_again_and_match_a_fresh_trainer(data):
    x, y, _, _ = data
    trainer, fresh = jax_dp.Trainer(2), jax_dp.Trainer(2)
    model, expected = build(), build()
    trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, verbose=0)
    fresh.fit(expected, x, y, global_batch_size=GLOBAL_BATCH, verbose=0)
    traced = traces(model)

    trainer.fit(model, x, y, global_batch_size=2 * GLOBAL_BATCH, verbose=0)
    jax_dp.Trainer(2).fit(expected, x, y, global_batch_size=2 * GLOBAL_BATCH, verbose=0)

    assert traces(model) > traced
    assert_weights_close(expected, model, atol=1e-6)


def _recompile_with_another_loss(model, trainer):
    model.compile(optimizer=model.optimizer, loss="mae", metrics=["mse"])  # same optimizer object and state
    return {}


def _recompile_with_another_optimizer(model, trainer):
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse", metrics=["mae"])
    return {}


def _clip_gradients(model, trainer):
    model.optimizer.clipnorm = 1e-3  # a Python number the step compiles in
    return {}


def _warm_up(model, trainer):
    return {"warmup_steps": 20}  # counted by the optimizer's iterations: 4 already, 12 after this fit


def _scale_the_learning_rate(model, trainer):
    return {"lr_scaling": dp_core.linear_scaling(16)}


def _freeze_batch_norm(model, trainer):
    # No trainable weights, so the variable lists stay the same; frozen, it normalizes with its moving statistics.
    model.get_layer("norm").trainable = False
    return {}


def _normalize_per_replica(model, trainer):
    trainer.batch_norm = "per_replica"
    return {}


CHANGES: dict[str, Callable[[keras.Model, jax_dp.Trainer], dict]] = {
    "recompiled with another loss": _recompile_with_another_loss,
    "recompiled with another optimizer": _recompile_with_another_optimizer,
    "optimizer setting": _clip_gradients,
    "warmup": _warm_up,
    "lr_scaling": _scale_the_learning_rate,
    "frozen BatchNormalization": _freeze_batch_norm,
    "trainer's batch_norm": _normalize_per_replica,
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_change_between_fits_compiles_again_and_matches_a_fresh_trainer(data, change):
    # A fresh Trainer compiles everything anew: what the cached trainer computes must equal it.
    x, y, _, _ = data
    runs = {}
    for name in ("cached", "fresh"):
        model, trainer = build(keras.optimizers.SGD(0.05, momentum=0.9), batch_norm=True), jax_dp.Trainer(2)
        trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
        traced = traces(model)
        fit_arguments = CHANGES[change](model, trainer)
        if name == "fresh":
            trainer = jax_dp.Trainer(2, batch_norm=trainer.batch_norm)
        history = trainer.fit(
            model, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0, **fit_arguments
        )
        runs[name] = model, history, traces(model) - traced

    (model, history, traced_again), (expected, expected_history, _) = runs["cached"], runs["fresh"]
    assert_weights_close(expected, model, atol=1e-6)
    assert_history_close(expected_history.history, history.history, atol=1e-6)
    assert traced_again > 0 or change == "lr_scaling"  # scaling alone sets the rate variable, read at run time


@pytest.mark.parametrize("warmups", [(0, 3, 0), (2, 4, 4)])
def test_an_optax_learning_rate_policy_change_matches_fresh_trainers(data, warmups):
    x, y, _, _ = data
    cached_model, expected = build(), build()
    cached = jax_dp.Trainer(2, optimizer=optax.adam(0.02))
    for warmup_steps in warmups:
        arguments = {"global_batch_size": GLOBAL_BATCH, "warmup_steps": warmup_steps, "shuffle": False, "verbose": 0}
        cached.fit(cached_model, x, y, **arguments)
        jax_dp.Trainer(2, optimizer=optax.adam(0.02)).fit(expected, x, y, **arguments)
        assert_weights_close(expected, cached_model, atol=1e-6)


def test_swapping_which_of_two_same_shaped_layers_trains_matches_a_fresh_trainer(data):
    # The weight lists keep their shapes, so only the cache's key tells the old steps from the new.
    x, y, _, _ = data
    cached_model, expected = build(), build()
    cached = jax_dp.Trainer(2, optimizer=optax.sgd(0.05))
    for frozen, training in (("second", "first"), ("first", "second")):
        before = {}
        for model, trainer in ((cached_model, cached), (expected, jax_dp.Trainer(2, optimizer=optax.sgd(0.05)))):
            model.get_layer(frozen).trainable, model.get_layer(training).trainable = False, True
            before[id(model)] = model.get_layer(frozen).get_weights()
            trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
        assert_weights_close(expected, cached_model, atol=1e-6)
        for still, was in zip(cached_model.get_layer(frozen).get_weights(), before[id(cached_model)], strict=True):
            np.testing.assert_array_equal(still, was)
        # Keras's own model.predict/evaluate keep their compiled functions across the swap: call
        # the model directly and evaluate with a fresh Trainer instead.
        np.testing.assert_allclose(
            cached.predict(cached_model, x, global_batch_size=GLOBAL_BATCH, verbose=0),
            keras.ops.convert_to_numpy(cached_model(x, training=False)),
            atol=1e-6,
        )
        arguments = {"global_batch_size": GLOBAL_BATCH, "return_dict": True, "verbose": 0}
        logs = cached.evaluate(cached_model, x, y, **arguments)
        assert_history_close(jax_dp.Trainer(2).evaluate(cached_model, x, y, **arguments), logs, atol=1e-6)


def test_freezing_a_layer_and_recompiling_keeps_it_and_matches_keras(data):
    x, y, _, _ = data
    runs = {}
    for name in ("keras", "jax_dp"):
        model = build(keras.optimizers.Adam(0.02))
        if name == "keras":
            fit = functools.partial(model.fit, batch_size=GLOBAL_BATCH)
        else:
            fit = functools.partial(jax_dp.Trainer(2).fit, model, global_batch_size=GLOBAL_BATCH)
        fit(x, y, shuffle=False, verbose=0)
        model.get_layer("first").trainable = False
        frozen = model.get_layer("first").get_weights()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mae", metrics=["mse"])  # as Keras asks
        history = fit(x, y, epochs=2, shuffle=False, verbose=0)
        for still, was in zip(model.get_layer("first").get_weights(), frozen, strict=True):
            np.testing.assert_array_equal(still, was)
        runs[name] = model, history

    (expected, expected_history), (model, history) = runs["keras"], runs["jax_dp"]
    assert_weights_close(expected, model)
    assert_history_close(expected_history.history, history.history)


def test_the_cache_keeps_no_model_alive(data):
    x, y, _, _ = data
    trainer = jax_dp.Trainer(2)
    model = build()
    trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, callbacks=[LogsOnly()], verbose=0)
    trainer.evaluate(model, x, y, global_batch_size=GLOBAL_BATCH, verbose=0)
    trainer.predict(model, x, global_batch_size=GLOBAL_BATCH, verbose=0)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None
