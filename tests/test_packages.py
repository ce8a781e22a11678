"""Every package imports, exports what it says, and keeps its import boundaries."""

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

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


SOURCES = {name: Path(__file__).parents[1] / "packages" / name / "src" / name for name in ("torch_dp", "jax_dp")}


def _imported_modules(path: Path) -> list[str]:
    modules = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return modules


@pytest.mark.parametrize("package", SOURCES)
def test_backends_import_only_public_dp_core_names(package):
    private = [
        f"{path.name}: {module}"
        for path in sorted(SOURCES[package].rglob("*.py"))
        for module in _imported_modules(path)
        if module.split(".")[0] == "dp_core" and any(part.startswith("_") for part in module.split(".")[1:])
    ]
    assert private == [], f"{package} imports private dp_core modules or names; make them public in dp_core(.keras)"


NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}  # public despite the underscore


def test_no_private_keras_attribute_outside_the_internals_module():
    sources = [*SOURCES.values(), Path(__file__).parents[1] / "packages" / "core" / "src" / "dp_core"]
    found = [
        f"{path.relative_to(path.parents[3])}:{node.lineno}: .{node.attr}"
        for root in sources
        for path in sorted(root.rglob("*.py"))
        if path.name != "_internals.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "os"))  # own state; os._exit
        and node.attr not in NAMEDTUPLE_API
    ]
    assert found == [], "read private Keras attributes through dp_core.keras.internals"


@pytest.mark.parametrize(("module", "page"), [("dp_core", "dp_core.md"), ("dp_core.keras", "dp_core_keras.md")])
def test_the_api_pages_that_list_their_members_list_every_public_name(module, page):
    """These pages name their members one by one; a name added to ``__all__`` must be added there too."""
    names = run_python(
        f"""
        import inspect, {module} as m
        print(" ".join(n for n in m.__all__ if not inspect.ismodule(getattr(m, n))))
        """,
        "jax",
    ).split()
    text = (Path(__file__).parents[1] / "docs" / "api" / page).read_text()
    listed = {line.strip().removeprefix("- ") for line in text.splitlines() if line.startswith("        - ")}
    assert sorted(set(names) - listed) == []
