"""Write docs/keras-compatibility.md from the parity scenarios' declarations.

    python tests/parity/compatibility.py            # rewrite the page
    python tests/parity/compatibility.py --check    # exit 1 when the page is stale

Rows come from ``inspect.signature(keras.Model.fit)`` (and ``evaluate``, ``predict``), so a
Keras argument without a status fails ``test_compatibility.py`` instead of going missing.
A status is what a scenario declares (``covers``, ``difference``, ``errors``); the few
arguments no scenario can cover carry a hand-written status below.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")  # any backend: the signatures are Keras's own
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras
from keras_suite.page import section as keras_suite_section

from parity.scenarios import BACKENDS, FLOAT16, FP32, SCENARIOS, Scenario

PAGE = Path(__file__).resolve().parents[2] / "docs" / "keras-compatibility.md"
METHODS = ("fit", "evaluate", "predict")
PACKAGES = {"torch": "torch_dp", "jax": "jax_dp"}

INPUT_KINDS = {
    "arrays": "numpy arrays",
    "tuple": "a tuple of arrays (several inputs)",
    "dict": "dicts of arrays (named inputs, outputs, sample weights)",
    "scipy_sparse": "a `scipy.sparse` matrix (the model is given its rows dense; Keras's jax adapter gives a BCOO)",
    "rows": "a map-style dataset of `(x, y)` rows (`__len__`/`__getitem__`)",
    "torch_dataset": "a `torch.utils.data.Dataset`",
    "PyDataset": "a `keras.utils.PyDataset` whose items are global batches",
    "generator": "a Python generator of global batches",
    "DataLoader": "a `torch.utils.data.DataLoader`, each batch a global batch",
    "tf.data": "a `tf.data.Dataset`",
    "grain": "a grain dataset",
}
TRAINER_ARGUMENTS = {
    "global_batch_size": "`global_batch_size=`, another name for `batch_size`",
    "seed": "`seed=`, the seed of the row order when `shuffle=True`",
    "model_factory": "a zero-argument function that returns the compiled model, in place of the model",
    "mesh": "`mesh=` and `layout=`: model parallel on a `('batch', 'model')` mesh, one layout dict on both backends",
    "placement": "a layout rule placing a whole layer on one mesh column (`model_to_gpu(layer, gpu_id=0)`)",
}
COMPILE_OPTIONS = {
    "steps_per_execution": "`model.compile(steps_per_execution=N)`: the batch hooks once every N steps",
    "no_loss": "`model.compile(optimizer)` without `loss=`: the model's `add_loss` terms are its loss",
}

# What no scenario can show, stated by hand.
_PRINTED = "progress is printed once, by the caller; the matrix runs `verbose=0` and does not compare printed text"
DIFFERENCES = {
    "fit.shuffle": "epoch `e` reads rows in `dp_core.epoch_order(num_samples, seed=seed, epoch=e)`, the same on "
    'any replica count (`shuffle="batch"`: Keras\'s blocks of a batch in order, the rows inside each '
    'shuffled, `epoch_order(..., shuffle="batch", batch_size=B)`); Keras draws its own order. The matrix '
    "gives Keras that order",
    "fit.verbose": _PRINTED,
    "evaluate.verbose": _PRINTED,
    "predict.verbose": _PRINTED,
}
NOT_VERIFIED = {
    "input.tf.data": "tensorflow is not installed where the matrix runs",
    "input.grain": "grain is not installed where the matrix runs",
    "input.DataLoader": "the matrix gives a DataLoader to torch_dp only",
    "input.torch_dataset": "the matrix gives a torch Dataset to torch_dp only",
}


def keras_arguments(method: str) -> list[str]:
    return [name for name in inspect.signature(getattr(keras.Model, method)).parameters if name != "self"]


def status(tag: str, backend: str) -> str | None:
    """The page's cell for ``tag`` on ``backend``, or None when nothing states one."""
    covering = [s for s in SCENARIOS if tag in s.covers and backend in s.backends]
    names = ", ".join(f"`{s.name}`" for s in covering)
    if refusing := [s for s in covering if backend in s.errors]:
        return "; ".join(_clear_error(s, backend) for s in refusing)
    if tag in DIFFERENCES:
        return f"supported with a stated difference: {DIFFERENCES[tag]}" + (f" ({names})" if covering else "")
    if differing := [s for s in covering if s.difference]:
        return "; ".join(f"supported with a stated difference: {s.difference} (`{s.name}`)" for s in differing)
    if covering:
        return f"exact ({names})"
    if tag in NOT_VERIFIED:
        return f"not verified: {NOT_VERIFIED[tag]}"
    return None


def _clear_error(scenario: Scenario, backend: str) -> str:
    types, word = scenario.errors[backend]
    return f"clear error: {' or '.join(types)} saying `{word}` (`{scenario.name}`)"


def missing_rows() -> list[str]:
    """Every Keras argument and input kind with no status on some backend."""
    tags = [f"{method}.{name}" for method in METHODS for name in keras_arguments(method)]
    tags += [f"input.{kind}" for kind in INPUT_KINDS]
    return [f"{tag} ({backend})" for tag in tags for backend in BACKENDS if status(tag, backend) is None]


def _table(header: str, rows: list[tuple[str, str]]) -> list[str]:
    lines = [f"| {header} | torch_dp | jax_dp |", "|---|---|---|"]
    for label, tag in rows:
        cells = [status(tag, backend) or "**no status**" for backend in BACKENDS]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    return lines


def _scenario_cell(scenario: Scenario, backend: str) -> str:
    if backend not in scenario.backends:
        return "not run"
    if backend in scenario.errors:
        return "clear error"
    if scenario.difference:
        return "stated difference"
    if scenario.rounding_baseline:
        return "within 10x model.fit's own rounding"
    return "exact" if scenario.tolerance in (None, FP32) else "exact within float16 noise"


# Differences from model.fit seen outside the matrix: each stays listed here until a scenario
# above shows it exact, stated or clearly refused.
KNOWN_GAPS = (
    "torch_dp, MobileNetV3Small (64x64, 96 or 99 rows): weights within `model.fit`'s own rounding"
    " baseline (2e-4 to 1.5e-3 relative) but not within fp32 noise, where jax_dp is exact (1e-7).",
    "A short last batch under gradient accumulation (`accumulate_steps`), or from a multi-process jax_dp"
    " batch source, stays padded: a model's batch-level terms (BatchNormalization statistics, an own"
    " `compute_loss`, row-dependent `add_loss`) see the masked rows.",
    "torch_dp computes an `add_loss` or `compute_loss` term on each replica's rows of a full batch: exact"
    " for a mean over rows; an `add_loss` term of another kind is warned about before training, and a model's"
    " own `compute_loss` is named there once (not run to ask: it runs once a step, as in `model.fit`).",
    "`evaluate(steps=)`, `predict(steps=)` and `fit(validation_steps=)` with arrays are refused where"
    " Keras accepts them (`steps_per_epoch` with arrays is read as Keras reads it).",
    "What a callback changes in `on_test_batch_begin` / `on_test_batch_end`, in the middle of an"
    " evaluation, reaches no other replica on torch_dp (changes at every other hook do).",
    "`keras.callbacks.TerminateOnNaN` with gradient accumulation (`accumulate_steps`): a non-finite loss"
    " still raises `NonFiniteLossError` at the window's end.",
    "torch_dp, a small `Sequential` with LoRA enabled on a Dense layer: equal to `model.fit` after one"
    " epoch, 7e-5 apart after the second (keras-hub's LoRA backbones are exact).",
    "`check_equivalence` on a compiled model with LoRA enabled: `keras.models.clone_model` rebuilds it"
    " without the LoRA weights; pass a model factory instead.",
    "torch_dp runs Keras's train step eagerly, on a data-parallel trainer and on a mesh: `compile(jit_compile=True)`"
    " (Keras's `torch.compile` of its step, off by default on torch) is not applied; the results are those of"
    " `model.fit`'s eager step. jax_dp compiles the step with `jax.jit` whatever `run_eagerly` and `jit_compile`"
    " say. Each trainer says so in a warning before training.",
)


def page() -> str:
    lines = [
        "# Keras compatibility",
        "",
        "<!-- Generated by tests/parity/compatibility.py from the parity scenarios; do not edit by hand. -->",
        "",
        "Does `Trainer(num_replicas=2).fit(model, ...)` give what `model.fit` gives on one device? Each",
        "scenario of `tests/parity/` runs the same Keras code twice in a fresh process per backend: with",
        "plain Keras on one device and with `torch_dp.Trainer(num_replicas=2)` or `jax_dp.Trainer(num_replicas=2)`,",
        "on 99 rows, so the last global batch is short and padded. Weights, History (each value and its",
        "type), `evaluate` and `predict` are compared (`nox -s parity`).",
        "",
        f"- **exact**: equal within fp32 reduction-order noise (rtol {FP32['rtol']:g}, atol {FP32['atol']:g});",
        f"  under `mixed_float16`, within float16 noise (rtol {FLOAT16['rtol']:g}, atol {FLOAT16['atol']:g}).",
        "- **supported with a stated difference**: works, and differs from `model.fit` only as stated.",
        "- **clear error**: raises before training, saying what to do instead.",
        "- **not verified**: no scenario runs it here.",
        "",
        "The scenario names in parentheses are the proof: `pytest tests/parity -k <name>`.",
        "",
        "## Known gaps",
        "",
        "Seen by trying real models and everyday Keras features outside the scenarios below; each is",
        "listed until a scenario shows it exact, stated or clearly refused:",
        "",
        *(f"- {gap}" for gap in KNOWN_GAPS),
    ]
    for method in METHODS:
        rows = [(f"`{'**' if name == 'kwargs' else ''}{name}`", f"{method}.{name}") for name in keras_arguments(method)]
        lines += ["", f"## `{method}` arguments", "", *_table("Keras argument", rows)]
    inputs = [(description, f"input.{kind}") for kind, description in INPUT_KINDS.items()]
    lines += ["", "## Inputs", "", *_table("`x` (and `y`, `validation_data`)", inputs)]
    extra = [(description, f"trainer.{name}") for name, description in TRAINER_ARGUMENTS.items()]
    extra += [(description, f"compile.{name}") for name, description in COMPILE_OPTIONS.items()]
    lines += ["", "## Beyond `model.fit`'s arguments", "", *_table("argument or option", extra)]
    lines += [
        "",
        "`lr_scaling=`, `warmup_steps=`, `checkpoint_dir=`, `checkpoint_every_steps=` and",
        "`checkpoint_in_background=` have no Keras counterpart; see [LR scaling and warmup](lr-scaling.md)",
        "and [Checkpoints and resume](checkpoints.md).",
        "",
        "## Scenarios",
        "",
        "| scenario | what it checks | torch_dp | jax_dp |",
        "|---|---|---|---|",
    ]
    for scenario in SCENARIOS:
        cells = " | ".join(_scenario_cell(scenario, backend) for backend in BACKENDS)
        lines.append(f"| `{scenario.name}` | {scenario.summary} | {cells} |")
    lines += keras_suite_section()  # Keras's own tests through each Trainer, from tests/keras_suite/results
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from what is generated")
    args = parser.parse_args()
    if missing := missing_rows():
        sys.exit(f"no status for: {', '.join(missing)}; add a scenario or a hand-written status")
    text = page()
    if args.check:
        sys.exit(0 if PAGE.read_text() == text else f"{PAGE} is stale: run python {Path(__file__).name}")
    PAGE.write_text(text)


if __name__ == "__main__":
    main()
