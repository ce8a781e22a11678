"""The house rules of docs/architecture.md, read from the sources' own imports (no package is
imported): which wing may import which, no import circle, small modules and functions.

A wing imports only the wings below it; the face (``__init__``, ``check``, ``doctor``,
``_trainer``, ``_equivalence``) imports any wing and nothing imports the face but the face. Each backend has its
own wing table: a wing one backend lacks (jax has no ``_scope``) is stated, not assumed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {
    "dp_core": ROOT / "packages/core/src/dp_core",
    "torch_dp": ROOT / "packages/torch_dp/src/torch_dp",
    "jax_dp": ROOT / "packages/jax_dp/src/jax_dp",
}
BACKENDS = ("torch_dp", "jax_dp")

# A wing's floor: it may import the floors below its own (and its own wing's other modules).
FACE = 7
WINGS = {
    "torch_dp": {
        "_processes": 6,
        "_loop": 5,
        "_scope": 4,
        "_mesh": 4,
        "_step": 3,
        "_data": 2,
        "_comm": 1,
        "_internals": 0,
    },
    "jax_dp": {"_processes": 6, "_loop": 5, "_step": 3, "_data": 2, "_comm": 1, "_mesh": 1, "_internals": 0},
}
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 70
# A function may be longer only where its docstring says why, starting with these words.
LONG_FUNCTION_MARK = "Longer than 70 lines:"


def _module_name(package: str, path: Path) -> str:
    parts = [package, *path.relative_to(SOURCES[package]).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(package, path): path for package, src in SOURCES.items() for path in sorted(src.rglob("*.py"))}


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project modules ``name`` imports (``from a.b import c`` counts ``a.b.c`` when that is a module)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from a import b`` imports the module a.b where there is one, else names of a
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in MODULES)
    found.discard(name)
    return found


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


FACES = {"__init__", "check", "doctor", "_trainer", "_equivalence"}


def _floor(module: str) -> tuple[str, int]:
    """The wing a backend module stands in ("face" for the face's modules), and its floor."""
    parts = module.split(".")
    wing = parts[1] if len(parts) > 1 else "__init__"
    return ("face", FACE) if wing in FACES else (wing, WINGS[parts[0]].get(wing, FACE))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backend_module_stands_in_one_of_its_wings_or_the_face(backend: str) -> None:
    wings = WINGS[backend]
    strays = [m for m in MODULES if m.startswith(f"{backend}.") and _floor(m)[0] not in {*wings, "face"}]
    assert not strays, f"{backend} modules outside its wings {sorted(wings)} and the face {sorted(FACES)}: {strays}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_wing_in_a_backend_s_table_is_there(backend: str) -> None:
    present = {_floor(m)[0] for m in MODULES if m.startswith(f"{backend}.")}
    assert sorted(set(WINGS[backend]) - present) == [], f"{backend}'s wing table names wings it does not have"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_wing_imports_only_the_wings_below_it(backend: str) -> None:
    upward = []
    for module, imported in IMPORTS.items():
        if not module.startswith(f"{backend}.") and module != backend:
            continue
        wing, floor = _floor(module)
        for target in imported:
            if not target.startswith(backend):
                continue
            target_wing, target_floor = _floor(target)
            if target_wing != wing and target_floor >= floor:
                upward.append(f"{module} (floor {floor}) imports {target} (floor {target_floor})")
    assert not upward, "imports that run up or sideways between wings:\n" + "\n".join(sorted(upward))


def test_packages_import_only_what_their_layer_allows() -> None:
    wrong = []
    for module, imported in IMPORTS.items():
        package = module.split(".")[0]
        for target in imported:
            other = target.split(".")[0]
            if package == "dp_core" and other != "dp_core":
                wrong.append(f"{module} imports the backend module {target}")
            elif package in BACKENDS and other in BACKENDS and other != package:
                wrong.append(f"{module} imports the other backend's {target}")
            elif package in BACKENDS and other == "dp_core" and any(p.startswith("_") for p in target.split(".")[1:]):
                wrong.append(f"{module} imports dp_core's private {target}: promote the name to dp_core's public API")
    assert not wrong, "\n".join(wrong)


def test_no_import_circle() -> None:
    state: dict[str, str] = {}
    circles: list[list[str]] = []

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for target in sorted(IMPORTS[module]):
            if state.get(target) == "open":
                circles.append([*trail[trail.index(target) :], target] if target in trail else [module, target])
            elif target not in state:
                visit(target, [*trail, target])
        state[module] = "done"

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [module])
    # a package's __init__ re-exporting its own submodules is no circle a reader follows
    circles = [c for c in circles if not any(MODULES[m].name == "__init__.py" for m in c)]
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_modules_and_functions_stay_small() -> None:
    too_long = []
    for module, path in MODULES.items():
        lines = path.read_text().count("\n")
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{module}: {lines} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                says_why = LONG_FUNCTION_MARK in (ast.get_docstring(node) or "")
                if length > MAX_FUNCTION_LINES and not says_why:
                    too_long.append(f"{module}.{node.name}: {length} lines (at most {MAX_FUNCTION_LINES})")
    assert not too_long, "\n".join(too_long)


def test_the_rules_see_the_code() -> None:
    """The checks above read something: every package's modules, and their imports."""
    assert {m.split(".")[0] for m in MODULES} == set(SOURCES)
    assert len(MODULES) > 60 and sum(len(i) for i in IMPORTS.values()) > 150
    for backend in BACKENDS:  # the face imports its wings
        assert any(target.startswith(f"{backend}._") for target in IMPORTS[f"{backend}._trainer"])
