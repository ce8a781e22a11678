"""Bad input fails fast, before anything compiles, with a message that says what to do."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from jax_dp_helpers import GLOBAL_BATCH, dense_bn_model

import jax_dp

pytestmark = pytest.mark.timeout(60)


def test_x_and_y_with_different_row_counts(data):
    x, y, _, _ = data
    with pytest.raises(ValueError, match="x has 99, y has 98"):
        jax_dp.Trainer(2).fit(dense_bn_model(), x, y[:-1], global_batch_size=GLOBAL_BATCH)


def test_uncompiled_model(data):
    x, y, _, _ = data
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"not compiled.*model.compile"):
        jax_dp.Trainer(2).fit(model, x, y, global_batch_size=GLOBAL_BATCH)


def test_not_a_model(data):
    x, y, _, _ = data
    with pytest.raises(TypeError, match="compiled keras.Model or a zero-argument callable"):
        jax_dp.Trainer(2).fit("model.keras", x, y, global_batch_size=GLOBAL_BATCH)


def test_keras_backend_other_than_jax(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    with pytest.raises(RuntimeError, match="KERAS_BACKEND=jax"):
        jax_dp.Trainer(2)


def test_more_replicas_than_devices_says_how_to_get_more():
    with pytest.raises(
        ValueError, match=r"num_replicas=64 but jax sees only 4 .*xla_force_host_platform_device_count=64"
    ):
        jax_dp.Trainer(64)


def test_optimizer_that_is_not_optax():
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        jax_dp.Trainer(2, optimizer=keras.optimizers.Adam())  # type: ignore[arg-type]


def test_unknown_batch_norm_mode():
    with pytest.raises(ValueError, match="batch_norm must be one of"):
        jax_dp.Trainer(2, batch_norm="sync")  # type: ignore[arg-type]


def test_malformed_validation_data(data):
    x, y, _, _ = data
    with pytest.raises(ValueError, match=r"validation_data must be \(x_val, y_val\)"):
        jax_dp.Trainer(2).fit(dense_bn_model(), x, y, global_batch_size=GLOBAL_BATCH, validation_data=(x,))


def test_checks_run_before_any_compile(data, monkeypatch):
    x, _, _, _ = data
    import jax_dp._step.recipes as recipes_module

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled before checking the input")

    monkeypatch.setattr(recipes_module, "make_train_step", no_compile)
    monkeypatch.setattr(recipes_module, "make_test_step", no_compile)
    with pytest.raises(ValueError, match="same number of rows"):
        jax_dp.Trainer(2).fit(dense_bn_model(), x, np.zeros((3, 1)), global_batch_size=GLOBAL_BATCH)
