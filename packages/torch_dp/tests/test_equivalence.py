"""torch_dp.check_equivalence and ``python -m torch_dp.check`` on real 2-replica gloo runs."""

import os
import subprocess
import sys

import numpy as np
import pytest
from torch_equivalence_models import data, dropout_model, exact_model

import torch_dp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
HERE = os.path.dirname(__file__)


def test_an_exact_model_is_equivalent_within_float32_rounding_at_a_global_batch_that_does_not_divide(capsys):
    x, y = data()
    # 33 rows on 2 replicas: the trainer pads each global batch to 34, the check compares it with 1 replica's 33
    report = torch_dp.check_equivalence(exact_model, x, y, global_batch_size=33, steps=4)
    assert report.global_batch_size == 33 and report.equivalent
    assert report.max_difference < 1e-5
    assert len(report.layer_differences) == 2
    assert len(report.losses) == len(report.replica_losses) == 4
    np.testing.assert_allclose(report.replica_losses, report.losses, rtol=1e-5)
    assert report.losses[0] != report.losses[-1]  # it trained
    assert all("rounding" in reason for reason in report.reasons)
    assert str(report) in capsys.readouterr().out  # printed


def test_dropout_is_equivalent_every_replica_draws_the_global_batch_s_masks():
    x, y = data()
    model = dropout_model()
    before = [w.copy() for w in model.get_weights()]
    report = torch_dp.check_equivalence(model, x, y, global_batch_size=32, steps=4, verbose=False)
    assert report.equivalent and report.max_difference < 1e-5
    assert all("random" not in reason for reason in report.reasons)
    np.testing.assert_allclose(report.replica_losses, report.losses, rtol=1e-5)
    for now, then in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(now, then)  # the caller's model did not train


def _check_command(model, *options):
    environment = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    command = [sys.executable, "-m", "torch_dp.check", f"torch_equivalence_models:{model}"]
    command += ["--data", "torch_equivalence_models:data", "--global-batch-size", "32", "--steps", "3", *options]
    return subprocess.run(command, cwd=HERE, env=environment, capture_output=True, text=True, timeout=240)


@pytest.mark.heavy  # among bare nox's slowest (its budget): nox -s heavy
def test_the_command_exits_0_when_equivalent_and_1_above_the_tolerance():
    exact = _check_command("exact_model")
    assert exact.returncode == 0, exact.stderr
    assert "Verdict: equivalent within float32 rounding" in exact.stdout
    different = _check_command("batch_norm_model", "--batch-norm", "per_replica", "--tolerance", "1e-4")
    assert different.returncode == 1, different.stderr
    assert "Verdict: different by design" in different.stdout
    assert 'batch_norm="per_replica"' in different.stdout


def test_the_rounding_baseline_shows_per_layer_what_nudged_inputs_move_on_one_replica():
    x, y = data()
    report = torch_dp.check_equivalence(
        exact_model, x, y, global_batch_size=32, steps=4, rounding_baseline=True, verbose=False
    )
    assert report.equivalent
    assert list(report.baseline_differences) == list(report.layer_differences)
    assert 0 < report.baseline < 1e-3  # inputs moved by 2**-20 move the weights, a little
    assert len(report.baseline_losses) == 4 and report.baseline_losses != report.losses
    assert "rounding baseline" in str(report).splitlines()[2]
