"""Every package imports, exports what it says, and keeps its import boundaries."""

import os
import subprocess
import sys
import textwrap

import pytest

PACKAGES = {"dp_core": None, "torch_dp": "torch", "jax_dp": "jax"}


def run_python(code, backend=None, timeout=240):
    env = dict(os.environ)
    if backend:
        env["KERAS_BACKEND"] = backend
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.parametrize(("package", "backend"), PACKAGES.items())
def test_every_public_name_imports_and_version_comes_from_metadata(package, backend):
    out = run_python(
        f"""
        import importlib.metadata, {package} as p
        missing = [n for n in p.__all__ if not hasattr(p, n)]
        print(missing, p.__version__ == importlib.metadata.version(p.__name__.replace("_", "-")))
        """,
        backend,
    )
    assert out == "[] True"


def test_importing_dp_core_loads_no_backend_even_when_all_are_installed():
    out = run_python(
        "import sys, dp_core; print(sorted(m for m in ('torch', 'jax', 'keras', 'flax', 'optax') if m in sys.modules))"
    )
    assert out == "[]"
