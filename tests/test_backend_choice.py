"""Each backend package, imported after Keras started on the other backend, raises the documented
error at import (docs/troubleshooting.md). Here, where both backends are installed; each package's own
tests check the backend it chooses when none was chosen."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(("package", "needs", "other"), [("torch_dp", "torch", "jax"), ("jax_dp", "jax", "torch")])
def test_importing_a_package_after_keras_on_the_other_backend_raises_the_documented_error(
    tmp_path, package, needs, other
):
    env = {key: value for key, value in os.environ.items() if key != "KERAS_BACKEND"}
    env["KERAS_HOME"] = str(tmp_path)  # no keras.json
    code = f"import os; os.environ['KERAS_BACKEND'] = '{other}'; import keras; import {package}"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=100)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"RuntimeError: {package} needs the Keras '{needs}' backend, but Keras is running on '{other}' "
        f"(KERAS_BACKEND='{other}')."
    ), result.stderr
    assert f"Set KERAS_BACKEND={needs} in the environment before Python starts" in last
