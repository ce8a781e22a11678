"""Run the parity matrix on one backend, in this (fresh) process; write what each side gave.

    KERAS_BACKEND=torch python tests/parity/run.py --output torch.json [--scenarios NAME ...] [--claims DIR]

Per scenario: plain Keras on one device, then ``<backend>_dp.Trainer(num_replicas=2)`` (a scenario with a
``mesh``: a Trainer of its own on that mesh, with its layout, closed after it); with a
rounding baseline, when the two differ beyond the scenario's tolerance, plain Keras once more on
inputs times 1 +- ``results.NUDGE`` (``nudged``). A
side that raises is recorded (type, message, traceback) and the next scenario runs; the
file is rewritten after every scenario, so a run cut short still reports what it did. One
Trainer serves the scenarios in turn (a Trainer is a session) until one of them fails. With
``--claims``, several runs share the scenarios: each takes the next one no other run has claimed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the ``parity`` package

import keras

from parity.results import NUDGE, differences, encode
from parity.runners import KerasRunner, Runner, TrainerRunner, trainer_arguments
from parity.scenarios import FP32, SCENARIOS, Scenario

NUM_REPLICAS = 2
SCENARIO_TIME_LIMIT = 600  # seconds per side; a hung collective must not stop the matrix (jax compiling a
# keras.applications model on 2 busy cores took over 240 s on plain Keras alone)


class ScenarioTimeoutError(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise ScenarioTimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def attempt(scenario: Scenario, runner: Runner) -> dict[str, Any]:
    """``{"result": ...}`` or ``{"error": ...}``, and the seconds it took."""
    keras.utils.clear_session()
    start = time.perf_counter()
    try:
        with time_limit(SCENARIO_TIME_LIMIT):
            entry: dict[str, Any] = {"result": encode(scenario.run(runner))}
    except Exception as error:  # every failure is a result here
        entry = {"error": described(error)}
    entry["seconds"] = round(time.perf_counter() - start, 2)
    return entry


def described(error: BaseException) -> dict[str, Any]:
    message = str(error).strip()
    return {
        "types": [cls.__name__ for cls in type(error).__mro__],
        "first_line": f"{type(error).__name__}: {message.splitlines()[0] if message else ''}",
        "message": message,
        "traceback": "".join(traceback.format_exception(error))[-4000:],
    }


class Trainers:
    """One Trainer for the scenarios in turn; a fresh one after a failure."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make, self.current = make, None

    def runner(self) -> TrainerRunner:
        if self.current is None:
            self.current = self.make()
        return TrainerRunner(self.current)

    def discard(self) -> None:
        trainer, self.current = self.current, None
        # A Trainer is a session (close() ends torch_dp's replicas); a Trainer built before
        # that contract has nothing to close.
        close = getattr(trainer, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                close()


def signatures(trainer_class: type) -> dict[str, list[str]]:
    return {
        method: [name for name in inspect.signature(getattr(trainer_class, method)).parameters if name != "self"]
        for method in ("fit", "evaluate", "predict")
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--scenarios", nargs="*", help="these only (none: only the signatures); default all")
    parser.add_argument("--claims", type=Path, help="a folder shared with other runs: each scenario runs in one")
    args = parser.parse_args()
    backend = keras.backend.backend()
    package = importlib.import_module(f"{backend}_dp")
    report: dict[str, Any] = {
        "backend": backend,
        "keras": keras.__version__,
        "signatures": signatures(package.Trainer),
        "scenarios": {},
    }
    trainers = Trainers(lambda: package.Trainer(**trainer_arguments(backend, NUM_REPLICAS, None, None)))
    wanted = set(args.scenarios) if args.scenarios is not None else {s.name for s in SCENARIOS}
    selected = [s for s in SCENARIOS if backend in s.backends and s.name in wanted]
    for scenario in selected:
        if args.claims is not None and not _claimed(args.claims / scenario.name):
            continue
        refused = backend in scenario.errors
        entry = {} if refused else {"keras": attempt(scenario, KerasRunner())}
        own = _own_trainers(package, backend, scenario)
        serving = own or trainers
        try:
            entry["trainer"] = attempt(scenario, serving.runner())
        except Exception as error:  # the Trainer itself could not start
            entry["trainer"] = {"error": described(error), "seconds": 0.0}
        if scenario.rounding_baseline and not refused and _beyond_tolerance(scenario, entry):
            entry["nudged"] = attempt(scenario, KerasRunner(nudge=NUDGE))
        if own is not None or ("error" in entry["trainer"] and not refused):
            serving.discard()
        report["scenarios"][scenario.name] = entry
        _write(args.output, report)
        outcome = {side: "error" if "error" in run else "ok" for side, run in entry.items()}
        seconds = sum(run["seconds"] for run in entry.values())
        print(f"{backend}: {scenario.name}: {outcome} ({seconds:.1f} s)", flush=True)
    trainers.discard()
    _write(args.output, report)


def _own_trainers(package: Any, backend: str, scenario: Scenario) -> Trainers | None:
    """A scenario on a mesh gets a Trainer of its own (its processes, its layout); None: the shared one serves."""
    if scenario.mesh is None:
        return None
    arguments = trainer_arguments(backend, NUM_REPLICAS, scenario.mesh, scenario.layout)
    return Trainers(lambda: package.Trainer(**arguments))


def _claimed(path: Path) -> bool:
    """Whether this run is the first to claim ``path`` (created exclusively, so one run wins)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _beyond_tolerance(scenario: Scenario, entry: dict[str, Any]) -> bool:
    """Whether the Trainer's result is outside the scenario's tolerance of Keras's: only then is
    Keras's run on nudged inputs (as long again) needed to judge it."""
    if any("error" in run for run in entry.values()):
        return False
    keras_result, trainer_result = (json.loads(json.dumps(entry[side]["result"])) for side in ("keras", "trainer"))
    return bool(differences(keras_result, trainer_result, scenario.tolerance or FP32))


def _write(path: Path, report: dict[str, Any]) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(report, indent=1))
    os.replace(partial, path)


if __name__ == "__main__":  # torch_dp spawns replicas that import this file
    main()
