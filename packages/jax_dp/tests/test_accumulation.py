"""Gradient accumulation: each replica sums its own gradients, all-reduced once per window.

Trained weights and History equal single-device ``model.fit`` with the same Keras optimizer
(windows across epoch ends, the padded last batch, global BatchNorm); optax's
``accumulate_steps`` equals ``optax.MultiSteps`` on one device; the compiled step all-reduces
the gradients only in the branch that ends a window; a checkpoint taken mid-window holds one
device's accumulators and resumes exactly.
"""

from __future__ import annotations

import re

import jax
import keras
import numpy as np
import optax
import pytest
from jax_dp_helpers import assert_history_close, assert_weights_close

import dp_core
import jax_dp
from dp_core.keras import build_model, checked_call
from jax_dp._data.batches import device_batches
from jax_dp._data.sources import epoch_plan
from jax_dp._mesh.layout import Placement
from jax_dp._step.hlo import all_reduces
from jax_dp._step.optimizers import KerasOptimizer
from jax_dp._step.state import train_state_on_mesh
from jax_dp._step.steps import make_train_step

pytestmark = pytest.mark.timeout(300)

NUM_SAMPLES = 100  # 4 full batches of 24 and a last one of 4 real rows: 5 steps an epoch,
GLOBAL_BATCH = 24  # so windows of 2 or 4 micro-steps run across epoch ends
SEED = 3


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_SAMPLES, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1)) + 0.1 * rng.normal(size=(NUM_SAMPLES, 1))).astype("float32")
    return x, y


def model_with(optimizer: keras.optimizers.Optimizer | None = None) -> keras.Model:
    """Dense + BatchNormalization; the same initial weights every time."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, use_bias=False),  # BN cancels a bias: its gradient is float noise
            keras.layers.BatchNormalization(),
            keras.layers.Activation("relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    return model


def keras_optimizer(name: str, steps: int) -> keras.optimizers.Optimizer:
    if name == "sgd":
        return keras.optimizers.SGD(0.1, momentum=0.5, gradient_accumulation_steps=steps)
    return keras.optimizers.Adam(0.01, gradient_accumulation_steps=steps)


def fit_on_one_device(model: keras.Model, x: np.ndarray, y: np.ndarray, epochs: range) -> dict[str, list]:
    """``model.fit`` epoch by epoch on the global batches jax_dp makes (its data order); the
    optimizer's iterations, hence its windows, run on across the calls."""
    history: dict[str, list] = {}
    for epoch in epochs:
        order = np.asarray(dp_core.epoch_order(NUM_SAMPLES, seed=SEED, epoch=epoch, shuffle=True))
        logs = model.fit(x[order], y[order], batch_size=GLOBAL_BATCH, shuffle=False, verbose=0).history
        for name, values in logs.items():
            history.setdefault(name, []).extend(values)
    return history


# Epochs chosen so the fit ends inside a window (15 micro-steps of 2, 10 of 4).
@pytest.mark.parametrize(("name", "steps", "num_replicas", "epochs"), [("sgd", 2, 2, 3), ("adam", 4, 4, 2)])
def test_keras_accumulation_equals_model_fit_on_one_device(data, name, steps, num_replicas, epochs):
    x, y = data
    expected = model_with(keras_optimizer(name, steps))
    expected_history = fit_on_one_device(expected, x, y, range(epochs))

    model = model_with(keras_optimizer(name, steps))
    history = jax_dp.Trainer(num_replicas).fit(
        model, x, y, global_batch_size=GLOBAL_BATCH, epochs=epochs, seed=SEED, accumulate_steps=steps, verbose=0
    )

    assert_history_close(expected_history, history.history)
    assert_weights_close(expected, model)
    # The caller's optimizer holds the open window's sum, as on one device.
    for want, got in zip(expected.optimizer.variables, model.optimizer.variables, strict=True):
        np.testing.assert_allclose(np.asarray(got.value), np.asarray(want.value), atol=1e-5, err_msg=want.path)
    assert any("accumulator" in v.path and np.abs(np.asarray(v.value)).max() > 0 for v in model.optimizer.variables)


def test_optax_accumulate_steps_equals_multisteps_on_one_device(data):
    x, y = data
    expected = model_with()
    one_device = jax_dp.Trainer(
        1, optimizer=optax.MultiSteps(optax.adam(0.01), every_k_schedule=2).gradient_transformation()
    )
    expected_history = one_device.fit(expected, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, seed=SEED, verbose=0)

    model = model_with()
    history = jax_dp.Trainer(2, optimizer=optax.adam(0.01)).fit(
        model, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, seed=SEED, accumulate_steps=2, verbose=0
    )

    assert_history_close(expected_history.history, history.history)
    assert_weights_close(expected, model)


def test_accumulate_steps_that_disagree_with_the_keras_optimizer_are_refused(data):
    x, y = data
    model = model_with(keras_optimizer("sgd", 2))
    with pytest.raises(ValueError, match=r"accumulate_steps=4 but .* set gradient_accumulation_steps=4 on it"):
        jax_dp.Trainer(2).fit(model, x, y, global_batch_size=GLOBAL_BATCH, accumulate_steps=4, verbose=0)
    with pytest.raises(ValueError, match=r"accumulate_steps must be a positive int .* got 0"):
        jax_dp.Trainer(2, optimizer=optax.sgd(0.1)).fit(model, x, y, global_batch_size=GLOBAL_BATCH, accumulate_steps=0)


def compiled_step(x: np.ndarray, y: np.ndarray, steps: int) -> str:
    """The compiled train step (HLO text) of a 2-replica fit with ``steps`` micro-steps a window."""
    trainer = jax_dp.Trainer(2)
    model, inputs, _, _ = checked_call(
        model_with(keras.optimizers.SGD(0.1, gradient_accumulation_steps=steps if steps > 1 else None)),
        x,
        y,
        batch_size=None,
        global_batch_size=GLOBAL_BATCH,
        step_names=("train_step",),
        checks=trainer._call_checks,
    )
    build_model(model, inputs)
    optimizer = KerasOptimizer(model)
    placement = Placement(trainer.mesh)
    step = make_train_step(model, optimizer, placement, batch_norm="global", skip_nonfinite=False)
    state = train_state_on_mesh(
        model, optimizer, placement, previous_optimizer_state=None, metric_sums=None, accumulate=True
    )
    plan = epoch_plan(inputs, layout=trainer.layout, order=dp_core.EpochOrder.in_input_order(GLOBAL_BATCH))
    batch = next(iter(device_batches(plan, trainer.mesh)))
    return step.lower(state, batch, True).compile().as_text()


def test_on_cpu_a_step_keeps_or_drops_its_whole_update_in_one_conditional(data):
    # a select of every weight, slot and metric on a non-finite loss made the guide's convnet step 6-8%
    # slower than model.fit's on CPU (state.step_taken); the compiled step holds one conditional, no select
    text = compiled_step(*data, steps=1)
    assert len(re.findall(r" conditional\(", text)) == 1
    assert not re.findall(r"f32\[6,16\]\{[0-9,]*\} select\(", text)  # the first kernel is not selected


def test_the_gradients_are_all_reduced_once_per_window(data):
    x, y = data
    kernel = {"f32[6,16]", "f32[16,6]"}  # the first Dense kernel's gradient, in either layout
    gradient_bytes = 4 * (6 * 16 + 16 + 16 + 16 * 1 + 1)

    text = compiled_step(x, y, steps=4)
    accumulating = all_reduces(text)
    at_window_end = [r for r in accumulating if r.in_branch]
    every_step = [r for r in accumulating if not r.in_branch]
    assert len(at_window_end) == 1  # one all-reduce, in the branch that ends a window...
    assert at_window_end[0].bytes == gradient_bytes  # ...carrying every gradient
    assert not any(kernel & set(r.shapes) for r in every_step)  # no gradient all-reduced per micro-step
    assert sum(r.bytes for r in every_step) < gradient_bytes  # BN moments and the loss only
    assert "all-gather" not in text and "all-to-all" not in text  # nor weights moved another way

    plain = all_reduces(compiled_step(x, y, steps=1))  # the check tells a step that all-reduces every step
    assert any(kernel & set(r.shapes) for r in plain if not r.in_branch)


def test_a_checkpoint_mid_window_holds_one_devices_accumulators_and_resumes_exactly(data, tmp_path):
    x, y = data
    expected = model_with(keras_optimizer("adam", 4))
    fit_on_one_device(expected, x, y, range(1))  # 5 micro-steps: one into the second window
    at_checkpoint = [np.asarray(v.value) for v in expected.optimizer.variables]
    expected_history = fit_on_one_device(expected, x, y, range(1, 2))

    jax_dp.Trainer(2).fit(
        model_with(keras_optimizer("adam", 4)),
        x,
        y,
        global_batch_size=GLOBAL_BATCH,
        epochs=1,
        seed=SEED,
        checkpoint_dir=str(tmp_path),
        verbose=0,
    )
    checkpoint = dp_core.latest_checkpoint(tmp_path)
    assert checkpoint is not None and (checkpoint.epoch, checkpoint.step) == (1, 0)
    for want, got in zip(at_checkpoint, checkpoint.optimizer_variables, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)  # the accumulators: one micro-step's sum

    resumed = model_with(keras_optimizer("adam", 4))
    resumed.set_weights([np.zeros_like(w) for w in resumed.get_weights()])  # replaced on resume
    history = jax_dp.Trainer(4).fit(
        resumed, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, seed=SEED, checkpoint_dir=str(tmp_path), verbose=0
    )

    assert_history_close(expected_history, {name: values[1:] for name, values in history.history.items()})
    assert_weights_close(expected, resumed)
    assert int(jax.device_get(resumed.optimizer.iterations)) == int(jax.device_get(expected.optimizer.iterations))
