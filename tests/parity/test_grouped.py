"""The reference of the ``steps_per_execution`` scenarios where Keras's torch loop refuses N > 1
(``parity.grouped``: the same steps, the hooks regrouped) equals Keras's own loop on jax: every
hook call, its step and its logs, and the weights (each backend in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parity.processes import backend_env

REPOSITORY = Path(__file__).resolve().parents[2]

KERAS_SIDE = """
import json, sys
sys.path.insert(0, "tests")
import numpy as np
from parity.grouped import keras_runs_groups
from parity.runners import KerasRunner
from parity.scenarios import BY_NAME
found = {"groups_itself": keras_runs_groups()}
for size in (4, 7):
    result = BY_NAME[f"steps_per_execution_{size}_hooks"].run(KerasRunner())
    found[size] = {
        "hooks": [[hook, step, {name: np.asarray(value).ravel().tolist() for name, value in (logs or {}).items()}]
                  for hook, step, logs in result["hooks"]],
        "weights": [weight.ravel().tolist() for weight in result["weights"]],
    }
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def keras_sides(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    directory = tmp_path_factory.mktemp("grouped")
    found = {}
    for backend in ("torch", "jax"):
        env = backend_env(backend, directory / "xla-cache")
        done = subprocess.run(
            [sys.executable, "-c", KERAS_SIDE],
            env=env,
            cwd=REPOSITORY,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        found[backend] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


@pytest.mark.parametrize("size", ["4", "7"])
def test_regrouped_hooks_equal_keras_s_own_groups(keras_sides, size):
    torch_side, jax_side = keras_sides["torch"][size], keras_sides["jax"][size]
    assert keras_sides["jax"]["groups_itself"]  # the jax side is Keras's own loop
    assert [call[:2] for call in torch_side["hooks"]] == [call[:2] for call in jax_side["hooks"]]
    ends = [call[1] for call in jax_side["hooks"] if call[0] == "train_end"]
    assert ends == ([3, 7, 11] if size == "4" else [6, 13]) * 2  # two epochs; the last group is short
    for (_, _, mine), (_, _, keras_own) in zip(torch_side["hooks"], jax_side["hooks"], strict=True):
        assert sorted(mine) == sorted(keras_own)
        for name in mine:
            np.testing.assert_allclose(mine[name], keras_own[name], rtol=1e-5, atol=5e-6)
    for mine, keras_own in zip(torch_side["weights"], jax_side["weights"], strict=True):
        np.testing.assert_allclose(mine, keras_own, rtol=1e-5, atol=5e-6)
