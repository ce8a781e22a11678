"""The "Keras's own tests" section of docs/keras-compatibility.md, written from ``results/<backend>.json``.

``tests/parity/compatibility.py`` writes the page and appends this section (``section()``), so the
page stays one generated file; ``nox -s keras_suite`` refreshes the results and the page.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
BACKENDS = {"torch": "torch_dp", "jax": "jax_dp"}
REASON_CHARS = 220


def _results() -> dict[str, dict]:
    paths = {backend: RESULTS / f"{backend}.json" for backend in BACKENDS}
    return {backend: json.loads(path.read_text()) for backend, path in paths.items() if path.exists()}


def _short(reason: str) -> str:
    """The reason's first sentence, without the test's own names (``got ExampleModel``), for grouping."""
    reason = re.sub(r"\bgot \w+ \(", "got a model (", reason)
    reason = re.sub(r"0x[0-9a-f]+", "0x…", reason)
    reason = re.sub(r"\(<(?:[^()]|\([^()]*\))*>\)", "(…)", reason)  # an object's repr (a distribution's mesh)
    reason = re.sub(r"<class '[^']*'>|'[\w.<>]+'", "'…'", reason)  # the test's own class, layer or function
    reason = re.sub(r"\bObject \w+ was", "Object … was", reason)
    reason = re.sub(
        r"must be a (compiled )?keras\.Model", "must be a (compiled) keras.Model", reason
    )  # fit's or predict's
    first = re.split(r"(?<=[a-z)`'])\. ", reason, maxsplit=1)[0]
    cut = first if len(first) <= REASON_CHARS else first[: REASON_CHARS - 1] + "…"
    return cut.replace("|", "\\|").replace("`", "'")


def _test_name(label: str) -> str:
    file, _, test = label.partition("::")
    where = file.rsplit("/", 1)[-1].removesuffix(".py")
    where = "mixins as Model" if file.startswith("trainer_test.py with") else where
    return f"{where}::{test.rsplit('::', 1)[-1]}"


def _grouped(results: dict, outcome: str) -> list[tuple[str, list[str]]]:
    groups: dict[str, list[str]] = defaultdict(list)
    for label, record in sorted(results["tests"].items()):
        if record["outcome"] == outcome:
            groups[_short(record["reason"])].append(_test_name(label))
    return sorted(groups.items(), key=lambda group: (-len(group[1]), group[0]))


def _listing(results: dict, outcome: str) -> list[str]:
    lines = []
    for reason, tests in _grouped(results, outcome):
        shown = ", ".join(f"`{test}`" for test in tests[:6]) + (f" and {len(tests) - 6} more" if len(tests) > 6 else "")
        lines.append(f"- {len(tests)}: {reason} ({shown})")
    return lines or ["- none"]


def _files(every: dict[str, dict]) -> str:
    files = {file.removeprefix("keras/src/") for results in every.values() for file in results["files"]}
    callbacks = sorted(file for file in files if file.startswith("callbacks/"))
    named = [f"`{file}`" for file in sorted(files - set(callbacks)) if not file.startswith("trainer_test.py with")]
    named = [f"{name} (jax only)" if "backend/jax" in name else name for name in named]
    mixins = any(file.startswith("trainer_test.py with") for file in files)
    again = (
        "; `trainers/trainer_test.py` once more with its mixin models made `keras.Model` subclasses" if mixins else ""
    )
    return ", ".join(named) + f" and the {len(callbacks)} of `callbacks/` (all but TensorBoard's and Orbax's){again}"


def section() -> list[str]:
    """The section's lines, starting with its heading."""
    every = _results()
    if not every:
        return []
    first = next(iter(every.values()))
    header = " | ".join(BACKENDS[backend] for backend in every)
    rows = [
        ("pass on plain Keras and call none of `fit`, `evaluate`, `predict` (not counted)", "uncalled"),
        ("pass on plain Keras and call them (counted)", "pass_on_plain_keras"),
        ("pass through the Trainer", "passed"),
        ("refused (a clear error of the Trainer's)", "refused"),
        ("fail", "failed"),
    ]
    lines = [
        "",
        "## Keras's own tests",
        "",
        "<!-- From tests/keras_suite/results/*.json (nox -s keras_suite); do not edit by hand. -->",
        "",
        f"Keras {first['keras']}'s own test files, as its wheel ships them, run first on plain Keras and then with",
        "`fit`, `evaluate` and `predict` routed through each Trainer on 2 replicas (`batch_size` becomes",
        "`global_batch_size`, every other argument unchanged; `tests/keras_suite/`). Only tests that pass on",
        f"plain Keras in the same environment count. The files: {_files(every)}. A refusal is a `ValueError`,",
        "`TypeError`, `NotImplementedError` or `RuntimeError` raised by the packages' own code (or a test of",
        "Keras's loop's insides, named in `tests/keras_suite/run.py`). A test's own `TestCase`, which some tests",
        "close over in a loss or a model class, reaches torch_dp's worker processes as a new instance of its",
        "class for the same test: pytest's holds its capture file, which cannot be pickled.",
        "",
        f"| tests | {header} |",
        "|---|" + "---|" * len(every),
    ]
    for title, key in rows:
        lines.append(f"| {title} | " + " | ".join(str(results["counts"][key]) for results in every.values()) + " |")
    subset = " | ".join(str(len(results["subset"])) for results in every.values())
    lines.append(f"| of those passing, run by bare `nox` (`conformance(keras='newest')`) | {subset} |")
    for backend, results in every.items():
        lines += ["", f"### {BACKENDS[backend]}: refused, by reason", "", *_listing(results, "refused")]
        lines += ["", f"### {BACKENDS[backend]}: failing, by error", "", *_listing(results, "failed")]
    return lines
