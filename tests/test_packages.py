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
ATTRIBUTE_FUNCTIONS = {"getattr", "setattr", "hasattr", "delattr"}  # name an attribute by a string
OBJECT_METHODS = {"__getattribute__", "__setattr__", "__delattr__"}  # object.__setattr__(obj, "_x", ...)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in NAMEDTUPLE_API


def _private_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """Where ``tree`` reads or writes an attribute with a private name of something not its own:
    ``x._name``, and ``getattr(x, "_name")`` (or ``setattr``, ``hasattr``, ``object.__setattr__``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "os")):  # own state; os._exit
                found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            function = node.func
            by_string = (isinstance(function, ast.Name) and function.id in ATTRIBUTE_FUNCTIONS) or (
                isinstance(function, ast.Attribute) and function.attr in OBJECT_METHODS
            )
            owner, name = node.args[0], node.args[1]
            own = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
            named = isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value)
            if by_string and named and not own:
                found.append((node.lineno, f'"{name.value}"'))
    return found


def test_no_private_attribute_outside_the_internals_modules():
    """Keras's private attributes are read in ``dp_core.keras.internals`` only, torch's, jax's and
    Python's in the backend's own ``_internals.py``, each with its reason."""
    sources = [*SOURCES.values(), Path(__file__).parents[1] / "packages" / "core" / "src" / "dp_core"]
    found = [
        f"{path.relative_to(path.parents[3])}:{line}: {name}"
        for root in sources
        for path in sorted(root.rglob("*.py"))
        if path.name != "_internals.py"
        for line, name in _private_reads(ast.parse(path.read_text()))
    ]
    assert found == [], "read private attributes through dp_core.keras.internals or the backend's _internals.py"


def test_the_private_attribute_rule_sees_attributes_and_strings():
    code = """
self._own, cls._own, os._exit, point._replace, x.__class__, getattr(x, "__name__"), getattr(self, "_own")
model._loss_tracker
getattr(optimizer, "_trainable_variables", [])
setattr(process, "_inheriting", True)
hasattr(model, "_compile_loss")
object.__setattr__(layer, "_moments", None)
"""
    assert [name for _, name in _private_reads(ast.parse(code))] == [
        "._loss_tracker",
        '"_trainable_variables"',
        '"_inheriting"',
        '"_compile_loss"',
        '"_moments"',
    ]
    modules = ["jax._src", "jax._src.distributed", "keras.src.backend", "jax.experimental", "jax_dp._internals"]
    assert [_private_module(module) for module in modules] == [True, True, True, False, False]


def _private_module(module: str) -> bool:
    """``jax._src``, ``keras.src.backend``, ``torch.distributed._tools``: another package's private module."""
    parts = module.split(".")
    return parts[0] not in ("dp_core", *SOURCES) and (parts[1:2] == ["src"] or any(map(_private, parts[1:])))


def test_private_modules_of_other_packages_are_imported_by_the_internals_modules_only():
    """``jax._src``, ``keras.src`` and the like: where a release moves them, one module shows it."""
    sources = [*SOURCES.values(), Path(__file__).parents[1] / "packages" / "core" / "src" / "dp_core"]
    found = [
        f"{path.relative_to(path.parents[3])}: {module}"
        for root in sources
        for path in sorted(root.rglob("*.py"))
        if path.name != "_internals.py"
        for module in _imported_modules(path)
        if _private_module(module)
    ]
    assert found == [], "import private modules in dp_core.keras's internals or the backend's _internals.py"


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
