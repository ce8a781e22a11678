"""The scaling report's MFU on torch: a step's FLOPs from ``FlopCounterMode`` (a Dense layer's
multiply-adds, forward and backward), the CPU's measured peak, and a profiled fit that trains
exactly as an unprofiled one (the count puts back every variable and random state it touches)."""

import keras
import numpy as np
import pytest
import torch

import torch_dp
from dp_core.keras import Inputs
from torch_dp._step.flops import flops_per_step, rows_to_count
from torch_dp._step.profile import compute_dtype

FEATURES, UNITS = 64, 32


def _data(rows: int = 256) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, FEATURES)).astype("float32"), rng.normal(size=(rows, 1)).astype("float32")


def _model(*layers: keras.layers.Layer) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)), *layers])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    return model


def test_a_dense_layer_counts_its_multiply_adds_forward_and_backward():
    x, _ = _data(16)
    # the first layer's backward computes its kernel's gradient only (the input needs none): 2 x forward
    alone = _model(keras.layers.Dense(UNITS))
    rows = (x, np.zeros((16, UNITS), "float32"), None)
    assert flops_per_step(alone, rows, global_batch_size=64) == 4 * 64 * FEATURES * UNITS
    # a later layer's backward computes its input's gradient too: 3 x forward
    deeper = _model(keras.layers.Dense(FEATURES), keras.layers.Dense(UNITS))
    expected = 4 * 64 * FEATURES * FEATURES + 6 * 64 * FEATURES * UNITS
    assert flops_per_step(deeper, rows, global_batch_size=64) == expected
    # nothing stays behind: no gradient, the weights untouched
    assert all(weight.value.grad is None for weight in deeper.trainable_weights)


def test_the_rows_counted_are_one_replicas_padded_share_of_a_batch_that_does_not_divide():
    x, y = _data(99)
    counted = rows_to_count(Inputs(x, y), global_batch_size=33, num_replicas=2)  # padded to 34: 17 each
    np.testing.assert_array_equal(counted[0], x[:17])


def test_float32_is_looked_up_as_tf32_where_torch_lets_matmuls_use_it():
    model = _model(keras.layers.Dense(UNITS))
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert compute_dtype(model) == "float32"
        torch.set_float32_matmul_precision("high")
        assert compute_dtype(model) == "tf32"
    finally:
        torch.set_float32_matmul_precision(precision)


def _regressor() -> keras.Model:
    """Dense(64->32), BatchNormalization, Dropout and Dense(32->1): a forward pass in training mode
    moves the moving statistics and the dropout's seed, which the count must put back."""
    return _model(  # seeded each: set_random_seed alone gives each model another start
        keras.layers.Dense(UNITS, use_bias=False, kernel_initializer=keras.initializers.GlorotUniform(1)),
        keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.5, seed=2),
        keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(3)),
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_replicas_report_the_mfu_and_train_as_without_a_report(tmp_path, capfd):
    x, y = _data()
    fit = dict(global_batch_size=64, epochs=2, shuffle=False, verbose=0)
    with torch_dp.Trainer(num_replicas=2, timeout=60) as trainer:
        plain = _regressor()
        torch.manual_seed(0)
        trainer.fit(plain, x, y, **fit)
        plain_random = torch.random.get_rng_state()
        trainer.profile = tmp_path  # the same replicas: profiling is read per call
        profiled = _regressor()
        torch.manual_seed(0)
        trainer.fit(profiled, x, y, **fit)
        profiled_random = torch.random.get_rng_state()
        trainer.profile = None
    for variable, mine in zip(plain.variables, profiled.variables, strict=True):  # the seed's state included
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(mine), keras.ops.convert_to_numpy(variable))
    assert torch.equal(profiled_random, plain_random)

    report = trainer.scaling_report
    # one replica's 32 rows counted, times the 2 replicas: Dense(64->32) forward and its kernel's
    # gradient (2 x 2 x 64 x 32 per row), Dense(32->1) forward, kernel and input gradients (3 x 2 x 32)
    assert report.flops_per_step == 64 * (4 * FEATURES * UNITS + 6 * UNITS)
    assert report.flops_how.startswith("torch FlopCounterMode")
    assert report.peak_how == "measured" and report.peak_device == "cpu, float32 matmul"
    assert report.peak_flops_per_second > 1e8
    assert report.mfu == pytest.approx(report.flops_per_step / report.step_seconds / (2 * report.peak_flops_per_second))
    lines = [line for line in capfd.readouterr().out.splitlines() if "one replica" in line]
    assert len(lines) == 1 and ", MFU " in lines[0] and "% (peak measured: 2x " in lines[0]
