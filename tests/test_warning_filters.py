"""pyproject's filterwarnings hide the known third-party noise of a run and nothing of ours."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

NOISY = """
import warnings

import keras
import numpy as np

import dp_core


def test_a_fit_and_our_own_warning():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    model.fit(np.ones((8, 3)), np.ones((8, 2)), verbose=0, epochs=2)
    model.get_weights()  # Keras's np.array(variable): numpy 2's copy DeprecationWarning, from keras
    np.array(model.weights[0])  # the same warning from this file: not Keras's own call, so it shows
    dp_core.warn_oversubscribed(64, cores=2)
    warnings.warn("a warning of the project's own", DeprecationWarning)
"""


@pytest.mark.timeout(120)
def test_keras_numpy_copy_noise_is_hidden_and_every_other_warning_shows(tmp_path):
    (tmp_path / "test_noisy.py").write_text(NOISY)
    environment = {**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": str(ROOT / "packages" / "core" / "src")}
    command = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path)]
    done = subprocess.run(
        [*command, "-p", "no:cacheprovider", str(tmp_path / "test_noisy.py")],
        env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    summary = done.stdout[done.stdout.index("warnings summary") :]
    assert "1 passed, 3 warnings" in summary
    assert "ReplicasOverCoresWarning: 64 replicas on 2 cores" in summary
    assert "DeprecationWarning: a warning of the project's own" in summary
    # numpy's warning shows once, from the test's own np.array call; none from keras/src
    assert summary.count("__array__ implementation doesn't accept a copy keyword") == 1
    assert "keras/src" not in summary
