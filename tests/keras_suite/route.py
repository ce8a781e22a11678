"""A pytest plugin: Keras's own tests with ``Model.fit``, ``evaluate`` and ``predict`` run by a Trainer.

Loaded with ``-p keras_suite.route`` (``tests/`` on the path). ``--keras-suite-route`` replaces the three
methods on the backend's Keras trainer class (so plain models, ``Sequential``, functional models and a
test's own ``Trainer`` mixins all go through it) by calls of one ``torch_dp.Trainer`` or ``jax_dp.Trainer``
of 2 replicas, made at the first call and kept for the session: ``batch_size`` becomes
``global_batch_size``, every other argument the test gave is passed unchanged. Without the flag nothing
is replaced: the same run is plain Keras. Either way ``--keras-suite-results FILE`` records each test's
outcome (`Outcome`), which the runner (``run.py``) compares.

Routed, a test's own ``unittest.TestCase``, which some of Keras's tests close over in a loss or a model
class (``test_self.assertFalse(training)`` in ``compute_loss``), pickles as a new instance of its class
for the same test (``_test_case_by_name``): pytest's holds its capture file, which cannot be sent to
torch-dp's worker processes; the copy's assertions fail there as the test's would here.

State held by this module: the patched methods (``TestCase.__reduce__`` among them) and the session's
Trainer (closed at the session's end); a call made while a Trainer call runs (the Trainer's own use of
the model) goes to Keras's own method.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import threading
import traceback
import unittest
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

NUM_REPLICAS = 2
METHODS = ("fit", "evaluate", "predict")
# A refusal: one of these raised by the Trainer's own code (its innermost frame in one of the packages);
# not torch-dp's WorkerError (a RuntimeError), which relays a replica's failure.
REFUSAL_TYPES = (ValueError, TypeError, NotImplementedError, RuntimeError)
PACKAGES = ("dp_core", "torch_dp", "jax_dp")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One test's result: ``passed``, ``failed``, ``refused`` (a Trainer's clear error) or ``skipped``;
    routed, a test that passed without calling ``fit``, ``evaluate`` or ``predict`` is ``uncalled``."""

    outcome: str
    seconds: float
    reason: str = ""


class _Router:
    """The session's Trainer, made at the first routed call, and whether a call of it runs now."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.trainer: Any = None
        self.calls = 0  # routed calls so far, in the whole session
        self._inside = threading.local()

    def running(self) -> bool:
        return getattr(self._inside, "call", False)

    def call(self, method: str, model: Any, arguments: dict[str, Any]) -> Any:
        if self.trainer is None:
            if self.backend == "torch":
                import torch_dp

                self.trainer = torch_dp.Trainer(num_replicas=NUM_REPLICAS)
            else:
                import jax_dp

                self.trainer = jax_dp.Trainer(num_replicas=NUM_REPLICAS)
        self.calls += 1
        self._inside.call = True
        try:
            return getattr(self.trainer, method)(model, **arguments)
        finally:
            self._inside.call = False

    def close(self) -> None:
        if self.trainer is not None and hasattr(self.trainer, "close"):
            self.trainer.close()


def _routed(router: _Router, method: str, keras_method: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(keras_method)

    @functools.wraps(keras_method)
    def call(model: Any, *args: Any, **kwargs: Any) -> Any:
        if router.running():
            return keras_method(model, *args, **kwargs)
        given = signature.bind(model, *args, **kwargs).arguments  # only what the test passed
        arguments = {name: value for name, value in given.items() if name not in {"self", "kwargs"}}
        arguments.update(given.get("kwargs", {}))  # evaluate's **kwargs: the Trainer says what it takes
        if arguments.get("batch_size") is not None:
            arguments["global_batch_size"] = arguments.pop("batch_size")
        return router.call(method, model, arguments)

    return call


def _keras_trainer_class() -> type:
    """The backend's Keras trainer class, the first of ``keras.Model``'s bases to define ``fit``."""
    import keras

    return next(base for base in keras.Model.__mro__ if "fit" in vars(base))


def _is_refusal(excinfo: pytest.ExceptionInfo[BaseException]) -> bool:
    if not isinstance(excinfo.value, REFUSAL_TYPES) or type(excinfo.value).__name__ == "WorkerError":
        return False
    raised_in = excinfo.traceback[-1].path
    return any(f"{os.sep}{package}{os.sep}" in str(raised_in) for package in PACKAGES)


def _reason(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    lines = traceback.format_exception_only(excinfo.type, excinfo.value)
    return " ".join(" ".join(lines).split())[:300]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("keras_suite")
    group.addoption("--keras-suite-route", action="store_true", help="run fit/evaluate/predict by a Trainer")
    group.addoption("--keras-suite-results", default=None, help="write each test's outcome to this JSON file")
    group.addoption("--keras-suite-select", default=None, help="a JSON file's list of node ids: run only those")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "requires_trainable_backend: Keras's own marker")
    if not config.getoption("--keras-suite-route"):
        return
    router = _Router(os.environ["KERAS_BACKEND"])
    keras_class = _keras_trainer_class()
    originals = {method: vars(keras_class)[method] for method in METHODS}
    for method, keras_method in originals.items():
        setattr(keras_class, method, _routed(router, method, keras_method))
    config.stash[_ROUTER] = router
    unittest.TestCase.__reduce__ = _test_case_by_name  # type: ignore[method-assign]


def _test_case_by_name(case: unittest.TestCase) -> tuple[Any, ...]:
    """A test case as its class and test's name (a new instance: no pytest capture, no outcome)."""
    return type(case), (case._testMethodName,)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Only the selected tests (a test of the list that this Keras lacks is simply not run)."""
    if path := config.getoption("--keras-suite-select"):
        chosen = set(json.loads(Path(path).read_text()))
        kept = [item for item in items if item.nodeid in chosen]
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in chosen])
        items[:] = kept


_ROUTER = pytest.StashKey[_Router]()
_OUTCOMES = pytest.StashKey[dict[str, Outcome]]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Any:
    """Routed, a passing test that made no routed call says so (it tests nothing of a Trainer's)."""
    router = item.config.stash.get(_ROUTER, None)
    before = router.calls if router is not None else 0
    yield
    outcomes = item.config.stash.get(_OUTCOMES, {})
    if router is not None and router.calls == before and outcomes.get(item.nodeid, Outcome("", 0)).outcome == "passed":
        outcomes[item.nodeid] = dataclasses.replace(outcomes[item.nodeid], outcome="uncalled")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = (yield).get_result()
    outcomes = item.config.stash.setdefault(_OUTCOMES, {})
    if report.when == "call" or report.outcome != "passed":
        if report.outcome == "failed" and call.excinfo is not None:
            kind = "refused" if _is_refusal(call.excinfo) else "failed"
            outcomes[item.nodeid] = Outcome(kind, round(call.duration, 3), _reason(call.excinfo))
        elif report.outcome == "skipped":
            outcomes[item.nodeid] = Outcome("skipped", 0.0, str(report.longrepr[-1])[:300])  # type: ignore[index]
        elif report.outcome == "passed" and item.nodeid not in outcomes:
            outcomes[item.nodeid] = Outcome("passed", round(call.duration, 3))


def pytest_unconfigure(config: pytest.Config) -> None:
    if (router := config.stash.get(_ROUTER, None)) is not None:
        router.close()
    if path := config.getoption("--keras-suite-results"):
        outcomes = config.stash.get(_OUTCOMES, {})
        records = {name: dataclasses.asdict(outcome) for name, outcome in sorted(outcomes.items())}
        Path(path).write_text(json.dumps(records, indent=1) + "\n")
