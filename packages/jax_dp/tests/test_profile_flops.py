"""The scaling report's MFU on jax (forced host devices): a step's FLOPs from XLA's cost analysis of
the compiled train step, one device's program times the devices, the same per sample on 1 and 2
devices; the CPU's measured peak; a profiled fit trains as an unprofiled one."""

import keras
import numpy as np
import pytest

import dp_core
import jax_dp

FEATURES, UNITS, GLOBAL_BATCH = 64, 32, 64


def _dense() -> keras.Model:
    model = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(UNITS, kernel_initializer=keras.initializers.GlorotUniform(0))]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """The reports of the Dense(64->32) layer's fits on 1 and 2 devices, and the model of each."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, FEATURES)).astype("float32")
    y = rng.normal(size=(256, UNITS)).astype("float32")
    fitted = {}
    for replicas in (1, 2):
        trainer = jax_dp.Trainer(num_replicas=replicas, profile=str(tmp_path_factory.mktemp("report")))
        model = _dense()
        trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
        fitted[replicas] = trainer.scaling_report, model
    return fitted, (x, y)


def test_a_dense_layers_flops_are_its_multiply_adds_forward_and_backward(reports):
    fitted, _ = reports
    # forward 2 x 64 x 32 per row, the kernel's gradient as much (the input needs none); XLA also
    # counts the bias, the loss and the update, elementwise: a few percent more
    matmuls = 4 * GLOBAL_BATCH * FEATURES * UNITS
    for report, _ in fitted.values():
        assert matmuls <= report.flops_per_step <= 1.1 * matmuls
        assert report.flops_how.startswith("XLA cost analysis of the compiled train step")
    # one device's program on 2 devices holds half the rows: times the devices, the same step
    per_sample = [fitted[n][0].flops_per_step / GLOBAL_BATCH for n in (1, 2)]
    assert per_sample[1] == pytest.approx(per_sample[0], rel=0.03)


def test_the_cpus_peak_is_measured_and_the_line_gives_the_mfu(reports):
    fitted, _ = reports
    report, _ = fitted[2]
    assert report.peak_how == "measured" and report.peak_device == "cpu, float32 matmul"
    assert report.peak_flops_per_second > 1e8 and report.devices is None  # one device per replica
    assert report.mfu == pytest.approx(report.flops_per_step / report.step_seconds / (2 * report.peak_flops_per_second))
    line = dp_core.scaling_summary(report)  # what the fit printed
    assert ", MFU " in line and "% (peak measured: 2x " in line and "FLOP/s)" in line


def test_a_profiled_fit_trains_as_an_unprofiled_one(reports):
    fitted, (x, y) = reports
    _, profiled = fitted[2]
    plain = _dense()
    jax_dp.Trainer(num_replicas=2).fit(plain, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    for mine, theirs in zip(profiled.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)
