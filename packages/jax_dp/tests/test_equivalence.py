"""jax_dp.check_equivalence and ``python -m jax_dp.check`` on a 1-device and a 2-device CPU mesh."""

from __future__ import annotations

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from jax_equivalence_models import batch_norm_model, data, dropout_model, exact_model

import jax_dp

pytestmark = pytest.mark.timeout(300)
HERE = os.path.dirname(__file__)


def test_an_exact_model_is_equivalent_within_float32_rounding(capsys):
    x, y = data()
    report = jax_dp.check_equivalence(exact_model, x, y, global_batch_size=32, steps=4)
    assert report.equivalent
    assert report.max_difference < 1e-5
    assert len(report.layer_differences) == 2
    assert len(report.losses) == len(report.replica_losses) == 4
    np.testing.assert_allclose(report.replica_losses, report.losses, rtol=1e-5)
    assert report.losses[0] != report.losses[-1]  # it trained
    assert all("rounding" in reason for reason in report.reasons)
    assert str(report) in capsys.readouterr().out  # printed


@pytest.mark.parametrize(("model", "global_batch_size", "num_replicas"), [(exact_model, 31, 2), (dropout_model, 5, 4)])
def test_a_global_batch_that_does_not_divide_is_checked_padded_as_the_trainer_pads_it(
    model, global_batch_size, num_replicas
):
    x, y = data()
    report = jax_dp.check_equivalence(
        model, x, y, global_batch_size=global_batch_size, steps=3, num_replicas=num_replicas, verbose=False
    )
    assert (report.global_batch_size, report.num_replicas) == (global_batch_size, num_replicas)
    assert report.equivalent and report.max_difference < 1e-5
    np.testing.assert_allclose(report.replica_losses, report.losses, rtol=1e-5)
    assert len(report.losses) == 3 and report.losses[0] != report.losses[-1]


def test_dropout_is_equivalent_on_jax_one_mask_per_global_batch():
    x, y = data()
    model = dropout_model()
    before = [w.copy() for w in model.get_weights()]
    report = jax_dp.check_equivalence(model, x, y, global_batch_size=32, steps=4, num_replicas=4, verbose=False)
    assert report.equivalent and report.max_difference < 1e-5
    assert all("random" not in reason for reason in report.reasons)
    for now, then in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(now, then)  # the caller's model did not train


def test_per_replica_batch_norm_differs_by_design_and_says_so():
    x, y = data()
    report = jax_dp.check_equivalence(
        batch_norm_model, x, y, global_batch_size=32, steps=4, batch_norm="per_replica", verbose=False
    )
    assert not report.equivalent
    assert report.max_difference > 1e-3
    [reason] = report.reasons
    assert reason.startswith('batch_norm="per_replica": BatchNormalization layers (batch_normalization')
    assert report.verdict.startswith("different by design")


def _check_command(model, *options):
    environment = {**os.environ, "KERAS_BACKEND": "jax", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    command = [sys.executable, "-m", "jax_dp.check", f"jax_equivalence_models:{model}"]
    command += ["--data", "jax_equivalence_models:data", "--global-batch-size", "32", "--steps", "3", *options]
    return subprocess.run(command, cwd=HERE, env=environment, capture_output=True, text=True, timeout=240)


@pytest.mark.heavy  # among bare nox's slowest (its budget): nox -s heavy
def test_the_command_exits_0_when_equivalent_1_above_the_tolerance_and_2_on_bad_arguments():
    exact = _check_command("exact_model")
    assert exact.returncode == 0, exact.stderr
    assert "Verdict: equivalent within float32 rounding" in exact.stdout
    different = _check_command("batch_norm_model", "--batch-norm", "per_replica", "--tolerance", "1e-4")
    assert different.returncode == 1, different.stderr
    assert "Verdict: different by design" in different.stdout
    too_many = _check_command("exact_model", "--replicas", "4")  # the command's jax sees 2 devices
    assert too_many.returncode == 2
    assert "num_replicas=4 but jax sees only 2 cpu device(s)" in too_many.stderr


def test_the_rounding_baseline_shows_per_layer_what_nudged_inputs_move_on_one_replica():
    # seeded: a nudge of 2**-20 moves a float32 loss by an ulp or two, and for some random weights by none
    keras.utils.set_random_seed(1)
    x, y = data()
    report = jax_dp.check_equivalence(
        exact_model, x, y, global_batch_size=32, steps=4, rounding_baseline=True, verbose=False
    )
    assert report.equivalent
    assert list(report.baseline_differences) == list(report.layer_differences)
    assert 0 < report.baseline < 1e-3  # inputs moved by 2**-20 move the weights, a little
    assert len(report.baseline_losses) == 4 and report.baseline_losses != report.losses
    assert "rounding baseline" in str(report).splitlines()[2]
