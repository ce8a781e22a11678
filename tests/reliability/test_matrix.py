"""The fault matrix names tests that exist, and docs/reliability.md lists exactly its rows.

The tests are found, not run (``nox -s reliability`` runs them): by reading the test files, and
by ``pytest --collect-only`` for a file whose cases only collecting can tell (``sorted(CASES)``).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reliability import report
from reliability.matrix import BACKENDS, GROUPS, ROWS, Row

REPOSITORY = Path(__file__).resolve().parents[2]
NAMED = [row for row in ROWS if not row.pending]


def _case_id(value: object) -> str:
    """pytest's id of a case given as a literal: ``"kill"``, ``1``, ``(1, "raise")`` -> ``1-raise``."""
    if isinstance(value, tuple):
        return "-".join(_case_id(part) for part in value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return str(value)
    raise ValueError(value)


def _cases(function: ast.FunctionDef) -> list[str] | None:
    """The case ids of a test: [] when it is not parametrized, None when the source does not say."""
    marks = [
        decorator
        for decorator in function.decorator_list
        if isinstance(decorator, ast.Call) and ast.unparse(decorator.func).endswith("mark.parametrize")
    ]
    if not marks:
        return []
    if len(marks) > 1 or len(marks[0].args) < 2 or marks[0].keywords:
        return None
    try:
        return [_case_id(value) for value in ast.literal_eval(marks[0].args[1])]
    except ValueError:
        return None


def _from_source(file: str) -> dict[str, list[str] | None]:
    tree = ast.parse((REPOSITORY / file).read_text(), filename=file)
    functions = (node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test"))
    return {function.name: _cases(function) for function in functions}


def _collect(files: list[str], backend: str) -> set[str]:
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
    environment = {**os.environ, "KERAS_BACKEND": backend}
    done = subprocess.run(command, cwd=REPOSITORY, env=environment, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"collecting {files} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return {line.strip() for line in done.stdout.splitlines() if "::" in line}


@pytest.fixture(scope="module")
def collected() -> set[str]:
    """The node ids of every test in the files the rows name, each case of a parametrized test included."""
    named_cases = {node_id.partition("[")[0] for row in NAMED for node_id in row.node_ids if "[" in node_id}
    node_ids, to_collect = set(), {}
    for file in sorted({node_id.partition("::")[0] for row in NAMED for node_id in row.node_ids}):
        for name, cases in _from_source(file).items():
            test = f"{file}::{name}"
            if cases is None and test in named_cases:
                backend = next(backend for folder, backend in GROUPS.values() if file.startswith(folder))
                to_collect.setdefault(backend, set()).add(file)
            node_ids |= {f"{test}[{case}]" for case in cases} if cases else {test}
    for backend, files in to_collect.items():
        found = _collect(sorted(files), backend)
        node_ids = {n for n in node_ids if n.partition("::")[0] not in files} | found
    return node_ids


def test_every_test_a_row_names_exists(collected):
    missing = [
        f"{node_id} (row: {row.fault})"
        for row in NAMED
        for node_id in row.node_ids
        if not any(found == node_id or found.startswith(node_id + "[") for found in collected)
    ]
    assert not missing, f"tests/reliability/matrix.py names tests pytest does not find: {missing}"


def test_a_test_split_into_rows_by_case_has_every_case_in_a_row(collected):
    """A new case of such a test (a crafted checkpoint, say) must get a row, not go missing from the page."""
    named = {node_id for row in NAMED for node_id in row.node_ids}
    split = {node_id.partition("[")[0] for node_id in named if "[" in node_id}
    left_out = sorted(found for found in collected if found.partition("[")[0] in split and found not in named)
    assert not left_out, f"cases no row of tests/reliability/matrix.py names: {left_out}"


def test_rows_are_well_formed():
    keys = [(row.fault, row.backend) for row in ROWS]
    assert len(set(keys)) == len(keys), f"rows named twice: {[k for k in keys if keys.count(k) > 1]}"
    for row in ROWS:
        assert row.backend in BACKENDS, f"{row.fault}: backend {row.backend!r}, expected one of {list(BACKENDS)}"
        assert row.bound_s is None or row.bound_s > 0, f"{row.fault}: bound {row.bound_s}"
        texts = [row.fault, row.outcome, *row.node_ids]
        assert not any("|" in text or "\n" in text for text in texts), f"{row.fault}: a '|' or a line break"
        assert isinstance(row.tests, (str, tuple)), f"{row.fault}: tests must be a node id or a tuple of them"
    if pending := [row.fault for row in ROWS if row.pending]:
        warnings.warn(f"{len(pending)} rows of the fault matrix wait for their tests: {pending}", stacklevel=1)


def _page_rows() -> list[list[str]]:
    lines = report.PAGE.read_text().splitlines()
    header = "| " + " | ".join(report.HEADER) + " |"
    assert header in lines, f"{report.PAGE} has no fault table: run nox -s reliability"
    rows = []
    for line in lines[lines.index(header) + 2 :]:
        if not line.startswith("| "):
            break
        cells = line.removeprefix("| ").removesuffix(" |").split(" | ")
        del cells[report.MEASURED]
        rows.append(cells)
    return rows


def test_the_page_lists_exactly_the_rows():
    on_page = _page_rows()
    expected = [report.static_cells(row) for row in NAMED]
    assert on_page == expected, (
        f"{report.PAGE} does not list the rows of tests/reliability/matrix.py "
        f"(on the page only: {[r[0] for r in on_page if r not in expected]}; "
        f"in matrix.py only: {[r[0] for r in expected if r not in on_page]}): run nox -s reliability"
    )


def test_the_report_refuses_rows_that_failed_did_not_run_or_are_pending():
    first, second = NAMED[0], NAMED[1]
    results = {
        node_id: report.Result(node_id, "passed", 1.0, of_the_fault=False) for row in NAMED for node_id in row.node_ids
    }
    assert report.problems(tuple(NAMED), results, without_pending=False) == []
    failed = {**results, first.node_ids[0]: report.Result(first.node_ids[0], "failed", 1.0, of_the_fault=False)}
    del failed[second.node_ids[0]]
    found = report.problems((first, second), failed, without_pending=False)
    assert found == [
        f"failed: {first.node_ids[0]} (row: {first.fault})",
        f"did not run: {second.node_ids[0]} (row: {second.fault})",
    ]
    pending = [row for row in ROWS if row.pending]
    if pending:
        assert len(report.problems(tuple(pending), {}, without_pending=False)) == len(pending)
        assert report.problems(tuple(pending), {}, without_pending=True) == []


def test_a_test_recording_fault_seconds_is_measured_by_it_and_the_others_by_their_call(tmp_path):
    (tmp_path / "torch.xml").write_text(
        '<testsuites><testsuite time="80.5" timestamp="2026-01-02T03:04:05+00:00">'
        '<testcase classname="packages.core.tests.test_a" name="test_x[zip_bomb]" file="packages/core/tests/test_a.py"'
        ' time="0.8"><properties><property name="fault_seconds" value="0.25"/></properties></testcase>'
        '<testcase classname="packages.core.tests.test_a.TestGroup" name="test_y" file="packages/core/tests/test_a.py"'
        ' time="80.0"><failure message="boom"/></testcase>'
        "</testsuite></testsuites>"
    )
    run = report.read_results([tmp_path / "torch.xml"])
    assert run.results == {
        "packages/core/tests/test_a.py::test_x[zip_bomb]": report.Result(
            "packages/core/tests/test_a.py::test_x[zip_bomb]", "passed", 0.25, of_the_fault=True
        ),
        "packages/core/tests/test_a.py::TestGroup::test_y": report.Result(
            "packages/core/tests/test_a.py::TestGroup::test_y", "failed", 80.0, of_the_fault=False
        ),
    }
    assert run.seconds == 80.5 and run.started.year == 2026
    row = Row("a fault", "both", "an outcome", 2, ("packages/core/tests/test_a.py::test_x",))
    assert report.measured_cell(row, run.results) == "0.250 s"
    both = Row("a fault", "both", "an outcome", None, tuple(run.results))
    assert report.measured_cell(both, run.results) == "80 s, slowest of 2 (whole test)"
    over = Row("a fault", "both", "an outcome", 0.1, ("packages/core/tests/test_a.py::test_x",))
    assert (
        "recorded 0.25 s, the row says at most 0.1 s" in report.problems((over,), run.results, without_pending=False)[0]
    )


def test_a_test_run_again_later_shows_its_later_result_and_says_so(tmp_path):
    def junit(name: str, timestamp: str, outcome: str) -> None:
        (tmp_path / name).write_text(
            f'<testsuites><testsuite time="9" timestamp="{timestamp}"><testcase classname="tests.test_a" name="test_y"'
            f' file="tests/test_a.py" time="9">{outcome}</testcase></testsuite></testsuites>'
        )

    junit("a_second_run.xml", "2026-01-02T04:00:00+00:00", "")
    junit("b_first_run.xml", "2026-01-02T03:00:00+00:00", '<failure message="too slow"/>')
    run = report.read_results(sorted(tmp_path.glob("*.xml")))
    assert run.results["tests/test_a.py::test_y"].outcome == "passed"
    assert [(r.node_id, r.outcome) for r in run.rerun] == [("tests/test_a.py::test_y", "failed")]
    assert run.started.hour == 3 and run.seconds == 18
