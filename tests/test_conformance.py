"""One scenario, every backend, the same answer.

Each backend runs every scenario of ``conformance/scenarios.py`` in a subprocess (its own
KERAS_BACKEND): single-device Keras, then its Trainer on each replica count. The tests assert
(a) N replicas equal 1 replica, (c) the Trainer equals single-device Keras, and (b) torch-dp
equals jax-dp from the same initial weights and data order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "conformance"))
from scenarios import SCENARIOS

RUNNER = Path(__file__).parent / "conformance" / "run_scenarios.py"
REPLICAS = {"torch": [1, 2], "jax": [1, 2, 4]}
# fp32 sums taken in another order (replicas, devices, backends' kernels) differ in the last
# bits; measured at most ~1e-6 over two epochs of these models, bounded here with margin.
SAME_BACKEND = {"rtol": 1e-5, "atol": 5e-6}
CROSS_BACKEND = {"rtol": 1e-5, "atol": 1e-5}


def _start(backend: str, directory: Path) -> subprocess.Popen[bytes]:
    """One backend's scenarios in a fresh process; its output goes to a file (a pipe could fill and block it)."""
    env = dict(os.environ, KERAS_BACKEND=backend, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    command = [sys.executable, str(RUNNER), "--replicas", *map(str, REPLICAS[backend])]
    with (directory / f"{backend}.log").open("wb") as log:
        return subprocess.Popen(
            [*command, "--output", str(directory / f"{backend}.npz")], stdout=log, stderr=subprocess.STDOUT, env=env
        )


def _finish(backend: str, process: subprocess.Popen[bytes], directory: Path) -> tuple[dict, dict]:
    try:
        returncode = process.wait(timeout=900)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        returncode = "killed after 900 s"
    output = directory / f"{backend}.npz"
    log = (directory / f"{backend}.log").read_text(errors="replace")
    assert returncode == 0, f"{backend} scenarios failed ({returncode}):\n{log[-9000:]}"
    with np.load(output, allow_pickle=False) as arrays:
        loaded = dict(arrays)
    return loaded, json.loads(output.with_suffix(".json").read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every backend's results; the backends run at once, each in its own process."""
    directory = tmp_path_factory.mktemp("conformance")
    started = {backend: _start(backend, directory) for backend in REPLICAS}
    return {backend: _finish(backend, process, directory) for backend, process in started.items()}


def _arrays(results, backend, scenario, runner, kind):
    arrays = results[backend][0]
    prefix = f"{scenario}/{runner}/{kind}/"
    return [
        arrays[key] for key in sorted((k for k in arrays if k.startswith(prefix)), key=lambda k: int(k[len(prefix) :]))
    ]


def _logs(results, backend, scenario, runner):
    return results[backend][1][f"{scenario}/{runner}"]


def assert_same(results, scenario, left, right, tolerance):
    """Weights, predictions, History and evaluate of two runs agree; the message names the worst."""
    (left_backend, left_runner), (right_backend, right_runner) = left, right
    where = f"scenario {scenario}: {left_backend}/{left_runner} vs {right_backend}/{right_runner}"
    for kind in ("weights", "predictions"):
        a = _arrays(results, left_backend, scenario, left_runner, kind)
        b = _arrays(results, right_backend, scenario, right_runner, kind)
        assert len(a) == len(b) > 0, f"{where}: {kind} counts {len(a)} vs {len(b)}"
        worst = max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            np.testing.assert_allclose(x, y, **tolerance, err_msg=f"{where}: {kind}[{i}] (largest diff {worst:.3g})")
    a_logs, b_logs = (
        _logs(results, left_backend, scenario, left_runner),
        _logs(results, right_backend, scenario, right_runner),
    )
    for section in ("history", "evaluate"):
        assert sorted(a_logs[section]) == sorted(b_logs[section]), f"{where}: {section} keys differ"
        for key in a_logs[section]:
            np.testing.assert_allclose(
                a_logs[section][key], b_logs[section][key], **tolerance, err_msg=f"{where}: {section}[{key!r}]"
            )
    # History holds what model.fit's does: floats, numpy arrays for vector metrics
    assert a_logs["history_types"] == b_logs["history_types"], f"{where}: History value types differ"
    # the caller's optimizer holds its compiled learning rate afterwards, as after model.fit
    np.testing.assert_allclose(a_logs["learning_rate"], b_logs["learning_rate"], rtol=1e-6, err_msg=f"{where}: rate")


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
@pytest.mark.parametrize(
    ("backend", "replicas"), [(b, r) for b, counts in REPLICAS.items() for r in counts], ids=lambda v: str(v)
)
def test_trainer_equals_single_device_keras(results, scenario, backend, replicas):
    assert_same(results, scenario, (backend, "keras"), (backend, f"{backend}_dp-{replicas}"), SAME_BACKEND)


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
@pytest.mark.parametrize(("backend", "replicas"), [(b, r) for b, counts in REPLICAS.items() for r in counts[1:]])
def test_n_replicas_equal_one(results, scenario, backend, replicas):
    assert_same(results, scenario, (backend, f"{backend}_dp-1"), (backend, f"{backend}_dp-{replicas}"), SAME_BACKEND)


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
def test_torch_dp_equals_jax_dp(results, scenario):
    assert_same(results, scenario, ("torch", "torch_dp-2"), ("jax", "jax_dp-2"), CROSS_BACKEND)
