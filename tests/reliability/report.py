"""Write docs/reliability.md, the fault matrix, from the fault tests' junit XML.

    python tests/reliability/report.py --check-rows                  # exit 1 while a row is pending
    python tests/reliability/report.py --results DIR [--output docs/reliability.md]

``nox -s reliability`` runs the tests of every row in ``matrix.py`` with ``--junitxml=DIR/<group>.xml``
and then this script. A row whose test failed, was skipped or did not run, and a row still pending,
make it exit 1 naming them, without writing the page; ``--without-pending`` leaves pending rows out
(and says so). The measured time of a test is the ``fault_seconds`` property it records with
``record_property``, or else its call time (``-o junit_duration_report=call``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reliability.matrix import BACKENDS, ROWS, Row

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
HEADER = ("Fault", "Backend", "Outcome the test asserts", "Bound", "Measured", "Test")
MEASURED = HEADER.index("Measured")
VERSIONS = ("keras", "torch", "jax", "dp-core", "torch-dp", "jax-dp")


@dataclass(frozen=True)
class Result:
    node_id: str
    outcome: str  # "passed", "failed", "error" or "skipped"
    seconds: float
    of_the_fault: bool  # seconds is the test's fault_seconds, not its whole call


def _node_id(testcase: ET.Element) -> str:
    """pytest's node id of a junit testcase: xunit1's ``file`` plus the classes and the name."""
    file, classname, name = testcase.get("file"), testcase.get("classname", ""), testcase.get("name", "")
    if not file:
        raise ValueError(f"testcase {classname}.{name} has no file attribute: run pytest with -o junit_family=xunit1")
    module = file.removesuffix(".py").replace("/", ".")
    classes = classname.removeprefix(module).strip(".")
    return "::".join([file, *classes.split(".")] if classes else [file]) + f"::{name}"


def _result(testcase: ET.Element) -> Result:
    tags = {child.tag for child in testcase}
    outcome = next((tag for tag in ("error", "failure", "skipped") if tag in tags), "passed")
    recorded = testcase.find("properties/property[@name='fault_seconds']")
    seconds = float(recorded.get("value", "nan") if recorded is not None else testcase.get("time", "nan"))
    return Result(_node_id(testcase), "failed" if outcome == "failure" else outcome, seconds, recorded is not None)


@dataclass(frozen=True)
class Run:
    results: dict[str, Result]
    started: datetime.datetime
    seconds: float  # all groups together
    rerun: tuple[Result, ...] = ()  # earlier results a later run of the same test replaced


def _started(root: ET.Element) -> datetime.datetime:
    return min(datetime.datetime.fromisoformat(suite.get("timestamp", "")) for suite in root.iter("testsuite"))


def read_results(paths: list[Path]) -> Run:
    """Every test's result in the junit XML files; a test run again (alone, say) keeps its latest result."""
    if not paths:
        raise FileNotFoundError("no junit XML files given: run the tests with --junitxml=DIR/<group>.xml first")
    roots = sorted((ET.parse(path).getroot() for path in paths), key=_started)
    results: dict[str, Result] = {}
    rerun, seconds = [], 0.0
    for root in roots:
        seconds += sum(float(suite.get("time", "0")) for suite in root.iter("testsuite"))
        for testcase in root.iter("testcase"):
            result = _result(testcase)
            if result.node_id in results:
                rerun.append(results[result.node_id])
            results[result.node_id] = result
    return Run(results, _started(roots[0]), seconds, tuple(rerun))


def results_of(node_id: str, results: dict[str, Result]) -> list[Result]:
    """The results a row's node id stands for: itself, or every case of a parametrized test."""
    return [r for key, r in results.items() if key == node_id or key.startswith(node_id + "[")]


def problems(rows: tuple[Row, ...], results: dict[str, Result], *, without_pending: bool) -> list[str]:
    """Why the page cannot be written: rows pending, tests failed, skipped, not run, or over the row's bound."""
    found = []
    for row in rows:
        if row.pending:
            if not without_pending:
                found.append(f"pending (no test named yet): {row.fault} ({row.backend})")
            continue
        for node_id in row.node_ids:
            matched = results_of(node_id, results)
            if not matched:
                found.append(f"did not run: {node_id} (row: {row.fault})")
            for result in matched:
                if result.outcome != "passed":
                    found.append(f"{result.outcome}: {result.node_id} (row: {row.fault})")
                elif result.of_the_fault and row.bound_s is not None and result.seconds > row.bound_s:
                    found.append(
                        f"over the row's bound: {result.node_id} recorded {result.seconds:.2f} s, the row says at most"
                        f" {row.bound_s:g} s: make the bound in matrix.py the one the test asserts"
                    )
    return found


def _seconds(value: float) -> str:
    if value < 0.001:
        return "< 0.001 s"
    return f"{value:.3f} s" if value < 1 else f"{value:.1f} s" if value < 10 else f"{value:.0f} s"


def measured_cell(row: Row, results: dict[str, Result]) -> str:
    matched = [r for node_id in row.node_ids for r in results_of(node_id, results)]
    slowest = max(matched, key=lambda r: r.seconds)
    text = _seconds(slowest.seconds)
    if len(matched) > 1:
        text += f", slowest of {len(matched)}"
    if not all(r.of_the_fault for r in matched):
        text += " (whole test)"
    return text


def tests_cell(row: Row) -> str:
    """Node ids in code, the cases of one parametrized test after its name."""
    cases: dict[str, list[str]] = {}
    for node_id in row.node_ids:
        test, _, case = node_id.partition("[")
        cases.setdefault(test, []).append(case.removesuffix("]"))
    parts = []
    for test, named in cases.items():
        if named == [""]:
            parts.append(f"`{test}`")
        else:
            parts.append(f"`{test}` " + ", ".join(f"`[{case}]`" for case in named))
    return "<br>".join(parts)


def static_cells(row: Row) -> list[str]:
    """The row's cells that come from matrix.py alone: every column but Measured."""
    bound = "—" if row.bound_s is None else f"{row.bound_s:g} s"
    return [row.fault, BACKENDS[row.backend], row.outcome, bound, tests_cell(row)]


def table_row(row: Row, results: dict[str, Result]) -> str:
    cells = static_cells(row)
    cells.insert(MEASURED, measured_cell(row, results))
    return "| " + " | ".join(cells) + " |"


def machine() -> str:
    versions = []
    for name in VERSIONS:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} not installed")
    return f"{platform.platform()}, {os.cpu_count()} cores, Python {platform.python_version()}; " + ", ".join(versions)


def _reruns(run: Run) -> list[str]:
    if not run.rerun:
        return []
    tests = "; ".join(f"`{first.node_id.partition('::')[2]}` ({first.outcome} the first time)" for first in run.rerun)
    return ["", f"Run a second time, alone, and shown from that run: {tests}."]


def page(rows: tuple[Row, ...], run: Run) -> str:
    lines = [
        "# Reliability",
        "",
        "<!-- Generated by tests/reliability/report.py from the fault tests' results; do not edit by hand. -->",
        "",
        "Each row is a fault keras-dp is tested against: what goes wrong, and in which process or replica;",
        "the outcome the test asserts; the time bound it asserts; the time measured in the run below; and",
        "the test. A measured time is the fault's own (for example how long loading a crafted checkpoint",
        "took) where the test records it, otherwise the whole test's, start-up of its processes and any",
        "reference run included, marked *(whole test)*. A row with several tests shows the slowest.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
        *(table_row(row, run.results) for row in rows),
        "",
        "## The run",
        "",
        f"Run on {run.started.date().isoformat()}, on {machine()}. The tests took"
        f" {run.seconds / 60:.0f} minutes, one at a time.",
        *_reruns(run),
        "",
        "## Regenerating this page",
        "",
        "`nox -s reliability` runs every test named above, each backend's with its own Keras backend",
        "(torch_dp's with `KERAS_BACKEND=torch`; jax_dp's, dp_core's and the network's with",
        "`KERAS_BACKEND=jax` on 4 forced host devices), writes their junit XML under",
        "`.nox/reliability/tmp/` and rewrites this page from it. The rows live in",
        "`tests/reliability/matrix.py`, one per line. A row whose test failed or did not run stops the",
        "page from being written, and `tests/reliability/test_matrix.py` (part of `nox -s conformance`)",
        "fails while this page and the rows disagree.",
        "",
    ]
    return "\n".join(lines)


def _refused(found: list[str]) -> bool:
    if found:
        print(f"{len(found)} problems keep the fault matrix off the page:", file=sys.stderr)
        for problem in found:
            print(f"  {problem}", file=sys.stderr)
        print("Fix the tests, or name a pending row's test in tests/reliability/matrix.py.", file=sys.stderr)
    return bool(found)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, help="the folder of junit XML files, one per group")
    parser.add_argument("--output", type=Path, default=PAGE)
    parser.add_argument("--check-rows", action="store_true", help="only check that no row is pending, and exit")
    parser.add_argument("--without-pending", action="store_true", help="leave rows whose tests are not named out")
    arguments = parser.parse_args()
    pending = tuple(row for row in ROWS if row.pending)
    if arguments.without_pending:
        for row in pending:
            print(f"left out, pending (no test named yet): {row.fault} ({row.backend})", file=sys.stderr)
    if arguments.check_rows:
        return int(_refused(problems(pending, {}, without_pending=arguments.without_pending)))
    if arguments.results is None:
        parser.error("--results is needed (or --check-rows)")
    run = read_results(sorted(arguments.results.glob("*.xml")))
    if _refused(problems(ROWS, run.results, without_pending=arguments.without_pending)):
        return 1
    arguments.output.write_text(page(tuple(row for row in ROWS if not row.pending), run))
    print(f"wrote {arguments.output}: {len(ROWS) - len(pending)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
