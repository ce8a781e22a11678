"""``import jax_dp`` (and ``python -m jax_dp.check``) with no Keras backend chosen chooses jax and says
so once (after Keras started on another backend: tests/test_backend_choice.py, where both are installed)."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def _python(arguments, tmp_path):
    """A fresh interpreter with KERAS_BACKEND unset and an empty Keras home (no keras.json: Keras's own
    default is tensorflow, which is not installed)."""
    env = {key: value for key, value in os.environ.items() if key != "KERAS_BACKEND"}
    env["KERAS_HOME"] = str(tmp_path)
    return subprocess.run([sys.executable, *arguments], capture_output=True, text=True, env=env, timeout=100)


def _said(result):
    return [line for line in result.stderr.splitlines() if "KERAS_BACKEND is not set" in line]


LINE = (
    "jax_dp: KERAS_BACKEND is not set, so jax_dp runs Keras on 'jax'. Set KERAS_BACKEND=jax before Python starts "
    "to say so yourself."
)


def test_importing_jax_dp_with_no_backend_chosen_runs_keras_on_jax_and_says_so_once(tmp_path):
    result = _python(
        ["-c", "import jax_dp, keras, os; print(keras.backend.backend(), os.environ['KERAS_BACKEND'])"], tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["jax", "jax"]
    assert _said(result) == [LINE]


def test_the_check_command_runs_with_no_backend_chosen(tmp_path):
    result = _python(["-m", "jax_dp.check", "--help"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m jax_dp.check")
    assert _said(result) == [LINE]
