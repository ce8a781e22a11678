"""``import torch_dp`` with no Keras backend chosen chooses torch and says so once (after Keras
started on another backend: tests/test_backend_choice.py, where both are installed)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)


def _python(code, tmp_path):
    """``code`` in a fresh interpreter with KERAS_BACKEND unset and an empty Keras home (no keras.json:
    Keras's own default is tensorflow, which is not installed)."""
    env = {key: value for key, value in os.environ.items() if key != "KERAS_BACKEND"}
    env["KERAS_HOME"] = str(tmp_path)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=100)


def test_importing_torch_dp_with_no_backend_chosen_runs_keras_on_torch_and_says_so_once(tmp_path):
    result = _python(
        "import torch_dp, keras, os; print(keras.backend.backend(), os.environ['KERAS_BACKEND'])", tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["torch", "torch"]
    said = [line for line in result.stderr.splitlines() if "KERAS_BACKEND is not set" in line]
    assert said == [
        "torch_dp: KERAS_BACKEND is not set, so torch_dp runs Keras on 'torch'. Set KERAS_BACKEND=torch "
        "before Python starts to say so yourself."
    ]


def test_every_launcher_snippet_of_the_multi_host_page_sets_keras_backend():
    """What torchrun, srun and sbatch start imports keras on its own: the snippet says which backend."""
    page = (Path(__file__).resolve().parents[3] / "docs" / "multi-host.md").read_text()
    blocks = re.findall(r"```(\w+)\n(.*?)```", page, flags=re.DOTALL)
    commands = [
        text
        for language, text in blocks
        if language == "bash"
        and any(line.split()[:1] in (["torchrun"], ["srun"]) for line in text.splitlines() if line.strip())
    ]
    scripts = [
        text for language, text in blocks if language == "python" and re.search(r"^import (torch|jax)_dp", text, re.M)
    ]
    assert len(commands) >= 3 and len(scripts) >= 2  # torchrun, sbatch, jax's srun; torch's and jax's scripts
    assert [text for text in commands if "export KERAS_BACKEND=" not in text] == []
    assert [text for text in scripts if 'os.environ["KERAS_BACKEND"] = ' not in text] == []
