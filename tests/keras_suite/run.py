"""Run Keras's own test files on plain Keras, then the ones that passed with fit/evaluate/predict routed
through a Trainer of 2 replicas (``route.py``), and write what each did.

    KERAS_BACKEND=jax python tests/keras_suite/run.py            # all files -> results/jax.json
    KERAS_BACKEND=torch python tests/keras_suite/run.py --subset  # the results' subset, routed, checked

The files are those the Keras wheel ships (``FILES``), and ``trainer_test.py`` once more with its
mixin models made ``keras.Model`` subclasses (``MIXIN_LABEL``: the one change that lets a Trainer take
them). Only tests that pass on plain Keras in this environment count. The full run writes
``results/<backend>.json`` (each counted test's outcome through the Trainer and its reason) and picks
the subset bare ``nox`` runs: passing tests, fastest first, ``SUBSET_SECONDS`` of test time, each
passing a second routed run (a test that does not is left out, its reason in ``flaky``). ``--subset``
runs those routed and exits 1 if one that passes on plain Keras fails through the Trainer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import keras

HERE = Path(__file__).resolve().parent
KERAS_ROOT = Path(keras.__file__).resolve().parent  # .../site-packages/keras
FILES = (
    "src/trainers/trainer_test.py",
    "src/models/model_test.py",
    "src/models/functional_test.py",
    *sorted(
        f"src/callbacks/{path.name}"
        for path in (KERAS_ROOT / "src/callbacks").glob("*_test.py")
        if path.name not in {"tensorboard_test.py", "orbax_checkpoint_test.py"}  # need tensorflow, orbax
    ),
)
BACKEND_FILES = {"jax": ("src/backend/jax/trainer_test.py",), "torch": ()}
MIXIN_LABEL = "trainer_test.py with its mixins as keras.Model"
MIXIN_FILE = "trainer_mixin_as_model_test.py"
# The one change: ``class ExampleModel(Trainer, layers.Dense)`` (a layer with Keras's backend Trainer mixed
# in) becomes ``class ExampleModel(layers.Dense, models.Model)``, the layer's own build and call first
# (``class StructModel(models.Model)`` for a plain ``layers.Layer``, which ``Model`` already is).
MIXIN_CLASS = re.compile(r"class (\w+)\(Trainer, layers\.(\w+)\):")


def _as_model(mixin: re.Match[str]) -> str:
    name, layer = mixin.groups()
    return f"class {name}(models.Model):" if layer == "Layer" else f"class {name}(layers.{layer}, models.Model):"


# Tests of how Keras's own loop works inside, not of what fit/evaluate/predict give: a Trainer runs its
# own loop. Such a test that fails through a Trainer counts as refused, with this reason.
BY_DESIGN = {
    "test_fit_eval_flow_for_jax_model_weights": "by design: the test checks that Keras's jax loop leaves the"
    " model's variables empty during fit (its state held outside them); a Trainer's loop keeps them filled",
}
NOT_RUN = {"outcome": "failed", "seconds": 0.0, "reason": "not run: the routed run ended before it"}
TEST_TIMEOUT_S = 120  # a test that hangs (a loop that never stops) fails after this
RUN_TIMEOUT_S = 3600
SUBSET_SECONDS = 5.0  # of test time per backend: with pytest, Keras and a Trainer starting, about 25 s a backend


@dataclasses.dataclass(frozen=True)
class Paths:
    """Where this run's test files are: a label (the node id's file part in results) to a path."""

    files: dict[str, Path]

    @classmethod
    def make(cls, backend: str, folder: Path) -> Paths:
        files = {f"keras/{name}": KERAS_ROOT / name for name in (*FILES, *BACKEND_FILES[backend])}
        source = (KERAS_ROOT / "src/trainers/trainer_test.py").read_text()
        variant, changed = MIXIN_CLASS.subn(_as_model, source)
        if changed:  # else this Keras has no such mixins: the variant is left out
            (folder / MIXIN_FILE).write_text(variant)
            files[MIXIN_LABEL] = folder / MIXIN_FILE
        return cls(files)

    def label(self, nodeid: str) -> str:
        """``/abs/path/x_test.py::Class::test`` as its label's ``keras/src/.../x_test.py::Class::test``."""
        path, _, rest = nodeid.partition("::")
        by_path = {str(file).lstrip("/"): label for label, file in self.files.items()}
        return f"{by_path.get(path, path)}::{rest}"

    def argument(self, label: str) -> str:
        file, _, rest = label.partition("::")
        return f"{self.files[file]}::{rest}"


def pytest(paths: Paths, labels: list[str] | None, *, route: bool, folder: Path) -> dict[str, dict]:
    """One pytest run of every file (``labels`` None) or of the tests ``labels`` names: each one's outcome by label.

    A label this Keras lacks is not run (and not in the answer), so a Keras release that renames a test
    leaves it out instead of stopping the run."""
    mode = "routed" if route else "plain"
    results, selection = folder / f"results-{mode}.json", folder / f"selection-{mode}.json"
    files = [str(file) for file in paths.files.values()]
    command = [sys.executable, "-m", "pytest", "-c", str(HERE / "keras_tests.ini"), "--rootdir=/", "-p", "no:warnings"]
    command += [f"--timeout={TEST_TIMEOUT_S}", f"--keras-suite-results={results}"]
    command += ["--continue-on-collection-errors"]  # a file that needs tensorflow is left out, not the run
    command += ["--keras-suite-route"] if route else []
    if labels is not None:
        if not labels:
            return {}
        selection.write_text(json.dumps([paths.argument(label).lstrip("/") for label in labels]))
        command += [f"--keras-suite-select={selection}"]
        files = sorted({str(paths.files[label.partition("::")[0]]) for label in labels})
    path = [str(HERE / "keras_conftest"), str(HERE.parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    count = "every test" if labels is None else f"{len(labels)} tests"
    how = "through the Trainer" if route else "plain Keras"
    print(f"keras_suite: {count} of {len(files)} files, {how}", flush=True)
    subprocess.run([*command, *files], env=env, cwd=folder, timeout=RUN_TIMEOUT_S, check=False, stdout=sys.stderr)
    return {paths.label(nodeid): record for nodeid, record in json.loads(results.read_text()).items()}


def full_run(backend: str, folder: Path) -> dict:
    paths = Paths.make(backend, folder)
    plain = pytest(paths, None, route=False, folder=folder)
    passing = sorted(label for label, record in plain.items() if record["outcome"] == "passed")
    routed = pytest(paths, passing, route=True, folder=folder)
    tests = {label: _by_design(label, routed.get(label, NOT_RUN)) for label in passing}
    subset, flaky = pick_subset(paths, tests, folder)
    return {
        "keras": keras.__version__,
        "backend": backend,
        "files": sorted(paths.files),
        "counts": counts(tests),
        "subset": subset,
        "flaky": flaky,
        "tests": tests,
    }


def _by_design(label: str, record: dict) -> dict:
    reason = BY_DESIGN.get(label.rsplit("::", 1)[-1])
    return {**record, "outcome": "refused", "reason": reason} if reason and record["outcome"] == "failed" else record


def counts(tests: dict[str, dict]) -> dict[str, int]:
    """Of the tests that pass on plain Keras and call fit, evaluate or predict: how they did through the Trainer;
    and how many passing tests call none of them (``uncalled``, not counted)."""
    outcomes = [record["outcome"] for record in tests.values()]
    by_kind = {kind: outcomes.count(kind) for kind in ("passed", "refused", "failed")}
    uncalled = outcomes.count("uncalled")
    return {"pass_on_plain_keras": len(outcomes) - uncalled, **by_kind, "uncalled": uncalled}


def pick_subset(paths: Paths, tests: dict[str, dict], folder: Path) -> tuple[list[str], dict[str, str]]:
    """The fastest passing tests up to ``SUBSET_SECONDS``, less those a second routed run does not pass."""
    chosen, total = [], 0.0
    for label in sorted((label for label, r in tests.items() if r["outcome"] == "passed"), key=_by_time(tests)):
        if total + tests[label]["seconds"] > SUBSET_SECONDS:
            break
        chosen.append(label)
        total += tests[label]["seconds"]
    again = pytest(paths, chosen, route=True, folder=folder)
    flaky = {
        label: f"passed, then {again.get(label, {}).get('outcome', 'not run')} in a second run through the Trainer"
        for label in chosen
        if again.get(label, {}).get("outcome") != "passed"
    }
    return [label for label in chosen if label not in flaky], flaky


def _by_time(tests: dict[str, dict]):
    return lambda label: (tests[label]["seconds"], label)


def subset_run(backend: str, folder: Path, results: dict) -> int:
    """Run the subset through the Trainer; a failure counts only if the test passes on plain Keras here."""
    paths = Paths.make(backend, folder)
    subset = [label for label in results["subset"] if label.partition("::")[0] in paths.files]
    routed = pytest(paths, subset, route=True, folder=folder)
    failed = [label for label in subset if routed.get(label, {}).get("outcome") != "passed"]
    if failed:
        plain = pytest(paths, failed, route=False, folder=folder)
        failed = [label for label in failed if plain.get(label, {}).get("outcome") == "passed"]
    for label in failed:
        print(f"keras_suite: {label} passes on plain Keras, not through the Trainer: {routed.get(label)}")
    print(f"keras_suite ({backend}): {len(subset) - len(failed)} of {len(subset)} of the subset passed")
    return 1 if failed or not subset else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--subset", action="store_true", help="run the results file's subset only")
    parser.add_argument("--pick-subset", action="store_true", help="pick the results file's subset again")
    parser.add_argument("--results", type=Path, default=None, help="default: results/<KERAS_BACKEND>.json")
    args = parser.parse_args()
    backend = os.environ["KERAS_BACKEND"]
    results_file = args.results or HERE / "results" / f"{backend}.json"
    with tempfile.TemporaryDirectory(prefix="keras_suite-") as temporary:
        if args.subset:
            return subset_run(backend, Path(temporary), json.loads(results_file.read_text()))
        if args.pick_subset:  # after a change of SUBSET_SECONDS: from the tests' times, checked by a second run
            results = json.loads(results_file.read_text())
            paths = Paths.make(backend, Path(temporary))
            results["subset"], results["flaky"] = pick_subset(paths, results["tests"], Path(temporary))
            results["counts"] = counts(results["tests"])
        else:
            results = full_run(backend, Path(temporary))
    results_file.parent.mkdir(exist_ok=True)
    results_file.write_text(json.dumps(results, indent=1) + "\n")
    print(f"keras_suite ({backend}): {results['counts']}; wrote {results_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
