"""The Keras parity matrix: ``Trainer(num_replicas=2)`` on torch and on jax against ``model.fit``.

Each backend runs every scenario in fresh subprocesses (``run.py``, its own KERAS_BACKEND; jax's
two share its scenarios): plain Keras on one device, then the backend's Trainer. One test per (scenario, backend) says
whether the Trainer gave what Keras gave; a failure names the scenario and the first places
that differ, or what the Trainer raised. A scenario with ``rounding_baseline`` is judged
against Keras's own run on nudged inputs (``results.rounding_differences``).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parity.processes import backend_env
from parity.results import differences, rounding_differences
from parity.scenarios import BACKENDS, BY_NAME, CROSS_BACKEND, FP32, SCENARIOS

RUNNER = Path(__file__).with_name("run.py")
TIMEOUT = 3600  # a whole backend; each side of a scenario has its own limit in run.py
# jax's scenarios, most of them compiles, take three times torch's: two processes share them
PROCESSES = {"torch": 1, "jax": 2}
# PARITY_RESULTS=<folder> compares the <backend>-<i>.json that run.py wrote there before.
REUSE = os.environ.get("PARITY_RESULTS")


def _start(backend: str, scenarios: list[str], directory: Path) -> list[subprocess.Popen[bytes]]:
    """One backend's matrix in fresh processes (``PROCESSES``), which share its scenarios; each
    process's output goes to a file (a pipe could fill and block it)."""
    started, claims = [], directory / f"{backend}-claims"
    claims.mkdir()
    for index in range(PROCESSES[backend]):
        name = f"{backend}-{index}"
        command = [sys.executable, str(RUNNER), "--output", str(directory / f"{name}.json"), "--scenarios", *scenarios]
        command += ["--claims", str(claims)]
        with (directory / f"{name}.log").open("wb") as log:
            env = backend_env(backend, directory.parent / "xla-cache")
            started.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
    return started


def _finish(backend: str, processes: list[subprocess.Popen[bytes]], directory: Path) -> dict[str, Any]:
    """Once its processes end, the backend's report: what they wrote, in the matrix's order."""
    ended = []
    for index, process in enumerate(processes):
        try:
            status = f"exit status {process.wait(timeout=TIMEOUT)}"
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            status = f"stopped after {TIMEOUT} s"
        log = (directory / f"{backend}-{index}.log").read_text(errors="replace")[-3000:]
        ended.append(f"{backend}-{index}: {status}\n{log}")
    return _report(backend, directory, "\n".join(ended) or f"read from {directory}")


def _report(backend: str, directory: Path, ended: str) -> dict[str, Any]:
    reports = [json.loads(path.read_text()) for path in sorted(directory.glob(f"{backend}-*.json"))]
    if not reports:
        pytest.fail(f"{backend}: the matrix wrote no results ({ended})")
    found = {name: entry for report in reports for name, entry in report["scenarios"].items()}
    ordered = {s.name: found[s.name] for s in SCENARIOS if s.name in found}
    return {**reports[0], "scenarios": ordered, "ended": ended}


def _selected(session: pytest.Session, backend: str) -> list[str]:
    """The scenarios the selected tests need on ``backend`` (``-k class_weight`` runs that one)."""
    needed = set()
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        params = callspec.params if callspec else {}
        if "scenario" in params and params.get("backend", backend) == backend:
            needed.add(params["scenario"])
    return [s.name for s in SCENARIOS if s.name in needed and backend in s.backends]


def _needs(session: pytest.Session, backend: str) -> bool:
    """Whether a selected test reads ``backend``'s results (its scenarios or its signatures)."""
    for item in session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "matrix" in getattr(item, "fixturenames", ()) and params.get("backend", backend) == backend:
            return True
    return False


@pytest.fixture(scope="module")
def matrix(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict]:
    """The results of each backend for the scenarios of the selected tests. The first use starts every
    backend's run at once (each in its own process, so neither waits for the other's start-up,
    compiles and single-device references) and waits for them all."""
    reports: dict[str, dict[str, Any]] = {}

    def results(backend: str) -> dict[str, Any]:
        if not reports:
            if REUSE:
                for name in BACKENDS:
                    reports[name] = _report(name, Path(REUSE), f"read from {REUSE}")
                return reports[backend]
            directory = tmp_path_factory.mktemp("parity")
            needed = [name for name in BACKENDS if _needs(request.session, name)]
            started = {name: _start(name, _selected(request.session, name), directory) for name in needed}
            reports.update({name: _finish(name, process, directory) for name, process in started.items()})
        return reports[backend]

    return results


def _side(report: dict[str, Any], scenario: str, side: str) -> dict[str, Any]:
    entry = report["scenarios"].get(scenario)
    if entry is None:
        pytest.fail(f"{report['backend']}: {scenario} did not run; the matrix ended with {report['ended']}")
    return entry[side]


def _baseline(report: dict[str, Any], scenario: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Keras's result and Keras's on nudged inputs: what rounding alone moves on this backend;
    None where run.py found the Trainer within the scenario's tolerance and so ran no baseline."""
    if "nudged" not in report["scenarios"].get(scenario, {}):
        return None
    runs = {side: _side(report, scenario, side) for side in ("keras", "nudged")}
    for side, run in runs.items():
        assert "error" not in run, f"the scenario fails on plain Keras ({side}, {report['backend']}): {_raised(run)}"
    return runs["keras"]["result"], runs["nudged"]["result"]


def _raised(run: dict[str, Any]) -> str:
    return f"{run['error']['first_line']}\n\n{run['error']['traceback']}"


def _compared(scenario: str, backend: str) -> Any:
    return pytest.param(scenario, backend, id=f"{scenario}-{backend}", marks=_marks(scenario))


def _marks(scenario: str) -> list[pytest.MarkDecorator]:
    return [pytest.mark.heavy] if BY_NAME[scenario].heavy else []


@pytest.mark.parametrize(
    ("scenario", "backend"), [_compared(s.name, b) for s in SCENARIOS for b in BACKENDS if s.compared_on(b)]
)
def test_trainer_gives_what_keras_gives(matrix, scenario, backend):
    report = matrix(backend)
    keras_run, trainer_run = _side(report, scenario, "keras"), _side(report, scenario, "trainer")
    assert "error" not in keras_run, f"the scenario fails on plain Keras ({backend}): {_raised(keras_run)}"
    assert "error" not in trainer_run, f"{backend}_dp raised {_raised(trainer_run)}"
    tolerance = BY_NAME[scenario].tolerance or FP32
    baseline = _baseline(report, scenario) if BY_NAME[scenario].rounding_baseline else None
    if baseline is not None:
        found = rounding_differences(keras_run["result"], trainer_run["result"], [baseline], tolerance, where=scenario)
    else:
        found = differences(keras_run["result"], trainer_run["result"], tolerance, where=scenario)
    assert not found, f"{backend}_dp differs from model.fit in {len(found)} places:\n" + "\n".join(found[:12])


@pytest.mark.parametrize(
    "scenario",
    [
        pytest.param(s.name, marks=_marks(s.name))
        for s in SCENARIOS
        if s.cross_backend and all(s.compared_on(b) for b in BACKENDS)
    ],
)
def test_torch_dp_equals_jax_dp(matrix, scenario):
    runs = {backend: _side(matrix(backend), scenario, "trainer") for backend in BACKENDS}
    for backend, run in runs.items():
        assert "error" not in run, f"{backend}_dp raised {_raised(run)}"
    tolerance = {key: max(CROSS_BACKEND[key], (BY_NAME[scenario].tolerance or FP32)[key]) for key in CROSS_BACKEND}
    torch_result, jax_result = runs["torch"]["result"], runs["jax"]["result"]
    # allowed what rounding moves on either backend, where a backend needed its baseline
    wanted = BACKENDS if BY_NAME[scenario].rounding_baseline else ()
    if baselines := [baseline for backend in wanted if (baseline := _baseline(matrix(backend), scenario)) is not None]:
        found = rounding_differences(torch_result, jax_result, baselines, tolerance, where=scenario)
    else:
        found = differences(torch_result, jax_result, tolerance, where=scenario)
    assert not found, f"torch_dp and jax_dp differ in {len(found)} places:\n" + "\n".join(found[:12])


@pytest.mark.parametrize(
    ("scenario", "backend"), [_compared(s.name, b) for s in SCENARIOS for b in s.backends if b in s.errors]
)
def test_trainer_gives_a_clear_error(matrix, scenario, backend):
    run = _side(matrix(backend), scenario, "trainer")
    types, named = BY_NAME[scenario].errors[backend]
    assert "error" in run, f"{backend}_dp accepted it without a word: {BY_NAME[scenario].summary}"
    assert set(types) & set(run["error"]["types"]), f"expected {' or '.join(types)}, got {_raised(run)}"
    assert named in run["error"]["message"], f"the message does not name {named!r}: {run['error']['first_line']}"


@pytest.mark.parametrize("method", ["fit", "evaluate", "predict"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_trainer_takes_every_keras_argument(matrix, backend, method):
    keras_names = [n for n in inspect.signature(getattr(keras.Model, method)).parameters if n not in {"self", "kwargs"}]
    taken = matrix(backend)["signatures"][method]
    missing = [name for name in keras_names if name not in taken]
    assert not missing, f"{backend}_dp.Trainer.{method} lacks model.{method}'s {', '.join(missing)}"
