"""The sessions as a newcomer meets them: ``nox -l`` descriptions that end at a sentence, a quick
session outside bare ``nox``, and README's tables naming every session with its time."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sessions():
    """Each ``@session`` function of noxfile.py: name -> (its docstring, the decorator's keywords)."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    found = {}
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            call = decorator if isinstance(decorator, ast.Call) else None
            target = call.func if call else decorator
            # nox.session, or the noxfile's own ``session`` that wraps it
            named = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
            if named == "session":
                keywords = {
                    k.arg: ast.literal_eval(k.value)
                    for k in (call.keywords if call else [])
                    if k.arg in {"default", "allow_parallel"}
                }
                found[node.name] = (ast.get_docstring(node) or "", keywords)
    return found


def _default_sessions():
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "nox.options.sessions":
            return ast.literal_eval(node.value)
    raise AssertionError("noxfile.py sets no nox.options.sessions")


def test_each_session_description_nox_lists_is_a_whole_sentence():
    """``nox -l`` shows a docstring's first line: it must end a sentence, with its brackets closed."""
    cut = {}
    for name, (docstring, _) in _sessions().items():
        first = docstring.splitlines()[0]
        whole = (
            first.endswith((".", ".)", "``.")) and first.count("(") == first.count(")") and first.count("`") % 2 == 0
        )
        if not whole or len(first) > 115:
            cut[name] = first
    assert cut == {}


def test_quick_is_on_request_and_its_tests_are_a_part_of_the_default_sessions():
    sessions = _sessions()
    assert sessions["quick"][1]["default"] is False
    defaults = _default_sessions()
    assert "quick" not in defaults and {"tests_core", "tests_torch"} <= set(defaults)
    source = ast.get_source_segment((ROOT / "noxfile.py").read_text(), _function("quick"))
    assert '"not multiprocess"' in source and "test_faults.py" in source and "test_checkpoints.py" in source


def _function(name):
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    return next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name)


def test_readme_gives_every_session_a_row_with_its_minutes():
    readme = (ROOT / "README.md").read_text()
    development = readme[readme.index("## Development") :]
    rows = [line for line in development.splitlines() if line.startswith("| `")]
    named = {name for row in rows for name in re.findall(r"`([a-z_]+)(?:[-(][^`]*)?`", row.split("|")[1])}
    missing = set(_sessions()) - named - {"gpu"}  # gpu: a GPU machine's, not timed on 2 cores
    assert missing == set(), f"add a row (session, what it runs, minutes) to README's Development tables: {missing}"
    for row in rows:
        minutes = row.split("|")[3].strip()
        assert re.match(r"\*?\*?\d", minutes), row
    assert "nox -s quick" in development


def test_every_session_removes_its_virtualenv_under_ci():
    """A CI runner's disk holds a few virtualenvs, not the dozen bare ``nox`` makes: every session
    goes through the noxfile's ``session``, which removes its virtualenv under CI when it ends."""
    source = (ROOT / "noxfile.py").read_text()
    assert "@nox.session" not in source
    assert len(_sessions()) >= 15
    wrapper = ast.get_source_segment(source, _function("session"))
    assert "_in_ci()" in wrapper and "finally:" in wrapper and "_remove_virtualenv(session)" in wrapper


def test_bare_nox_runs_two_sessions_at_a_time_but_a_session_that_measures_time_runs_alone():
    source = (ROOT / "noxfile.py").read_text()
    assert "nox.options.parallel = 2" in source and "nox.options.allow_parallel = True" in source
    alone = {name for name, (_, keywords) in _sessions().items() if keywords.get("allow_parallel") is False}
    benches = {"bench", "bench_features", "bench_keras_distribution", "bench_scope_memory", "bench_steps_per_execution"}
    assert alone == {"demo", *benches, "reliability", "gpu", "keras_suite"}
    assert set(_default_sessions()).isdisjoint(alone)


def test_a_lean_part_of_the_multi_host_tests_runs_in_bare_nox_and_every_one_in_reliability():
    """The namespace-host tests (tests/network/test_hosts_*.py) take minutes: bare ``nox`` runs the
    lean part ``HOSTS_LEAN`` names (torch's in tests_torch, jax's with jax's 2-process runs), and
    ``nox -s reliability`` every one that a row of the fault matrix names."""
    source = (ROOT / "noxfile.py").read_text()
    tree = ast.parse(source)
    lean = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "HOSTS_LEAN"
    )
    for backend, session in (("torch", "tests_torch"), ("jax", "tests_jax")):
        assert session in {name.split("-")[0].split("(")[0] for name in _default_sessions()}
        assert f'HOSTS_LEAN["{backend}"]' in ast.get_source_segment(source, _function(session))
        for node_id in lean[backend]:
            file, _, test = node_id.partition("::")
            assert (ROOT / file).exists() and (not test or f"def {test}(" in (ROOT / file).read_text()), node_id
    matrix = (ROOT / "tests/reliability/matrix.py").read_text()
    for file in sorted((ROOT / "tests/network").glob("test_hosts_*.py")):
        faults = re.findall(r"^def (test_\w+)\(", file.read_text(), re.MULTILINE)
        named = [test for test in faults if test in matrix]
        assert named and set(faults) - set(named) <= {"test_two_hosts_train_as_model_fit"}, (file.name, faults)


def test_keras_suite_runs_in_full_on_request_and_its_subset_in_bare_nox():
    """Keras's own tests through each Trainer: every one in ``nox -s keras_suite`` (on request, for
    both backends), the subset its results pick in ``conformance(keras='newest')``, for both too."""
    source = (ROOT / "noxfile.py").read_text()
    assert _sessions()["keras_suite"][1] == {"default": False, "allow_parallel": False}
    assert "keras_suite" not in _default_sessions() and "conformance(keras='newest')" in _default_sessions()
    backends = next(
        ast.literal_eval(node.value)
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "KERAS_SUITE_BACKENDS"
    )
    assert set(backends) == {"torch", "jax"}
    full = ast.get_source_segment(source, _function("keras_suite"))
    assert '"tests/keras_suite/run.py"' in full and "for backend in KERAS_SUITE_BACKENDS" in full
    conformance = ast.get_source_segment(source, _function("conformance"))
    assert '"tests/keras_suite/run.py", "--subset"' in conformance
    assert "for backend in KERAS_SUITE_BACKENDS" in conformance
