"""A check for machines with NVIDIA GPUs: torch-dp and jax-dp against plain ``model.fit``.

    nox -s gpu                      # installs the CUDA builds, then runs this script
    python benchmarks/gpu_check.py [--output docs/benchmarks.md] [--steps 30] [--backends torch jax]

For each backend, on the GPUs it sees: 1 replica against ``model.fit`` on the same GPU (weights
after the same steps, within a stated tolerance, and the ratio of step times), 2 replicas
against 1 when there are 2 GPUs, the same under ``mixed_float16``, and the peak GPU memory of
each run. Every run is a process of its own (Keras's backend is chosen per process, and a
fresh process gives each run its own peak memory). Prints a summary and replaces the page's
"GPU check" section; with no NVIDIA GPU it says so, leaves the page alone and exits with 1.

Imports nothing heavy at module level: ``benchmarks/report.py`` uses its page helpers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import page_sections  # this folder is on the path when the script runs

SECTION_HEADING = "## GPU check"
NO_GPU_EXIT = 1
GLOBAL_BATCH_SIZE = 128
# fp32 weights of runs that differ only in reduction order stay within this (max |difference|)
FLOAT32_TOLERANCE = 1e-4
# float16 compute rounds each activation to 11 bits: differences grow to this over the run
MIXED_TOLERANCE = 1e-2
CASES = ("fit", "dp1", "dp2", "fit_mixed", "dp1_mixed")
NOT_RUN = """{heading}

No NVIDIA GPU was available to run this check, so it has no numbers yet. On a machine with one
or more NVIDIA GPUs, `nox -s gpu` installs the CUDA builds (torch 2.13.0's default PyPI wheel,
`jax[cuda12]`) and runs `benchmarks/gpu_check.py`, which replaces this section with its results:
1 replica against `model.fit` on the same GPU (weights and step time), 2 replicas against 1 when
there are 2 GPUs, `mixed_float16`, and the peak GPU memory, for torch-dp and jax-dp.
"""


@dataclass(frozen=True)
class Comparison:
    """Two runs' weights side by side: the largest absolute difference against a tolerance."""

    name: str
    max_difference: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_difference <= self.tolerance


def compare_weights(name: str, weights: list[Any], expected: list[Any], tolerance: float) -> Comparison:
    """The largest absolute difference between two runs' weights (a NaN or a shape that
    differs counts as infinitely far)."""
    import numpy as np

    if len(weights) != len(expected):
        return Comparison(name, float("inf"), tolerance)
    largest = 0.0
    for mine, theirs in zip(weights, expected, strict=True):
        mine, theirs = np.asarray(mine, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
        if mine.shape != theirs.shape or not (np.isfinite(mine).all() and np.isfinite(theirs).all()):
            return Comparison(name, float("inf"), tolerance)
        if mine.size:
            largest = max(largest, float(np.max(np.abs(mine - theirs))))
    return Comparison(name, largest, tolerance)


# ---- the page ---------------------------------------------------------------------------


def section_of(page: str) -> str | None:
    """The page's "GPU check" section (heading to the next ``## `` heading), or None."""
    return page_sections.section_of(page, SECTION_HEADING)


def with_section(page: str, section: str) -> str:
    """``page`` with its "GPU check" section replaced by ``section`` (added at the end if absent)."""
    return page_sections.with_section(page, SECTION_HEADING, section)


def render_section(report: dict[str, Any]) -> str:
    """The markdown of one run's results."""
    machine = report["machine"]
    lines = [
        SECTION_HEADING,
        "",
        f"Written by `nox -s gpu` (`benchmarks/gpu_check.py`) on {report['date']}: "
        f"{len(machine['gpus'])} x {', '.join(sorted(set(machine['gpus'])))}, NVIDIA driver {machine['driver']}"
        f" (CUDA {machine['driver_cuda']}). Each run: {report['steps']} steps of global batch {GLOBAL_BATCH_SIZE}"
        " per epoch, 3 epochs, a small convnet (no Dropout, so that replicas and `model.fit` draw no random numbers);",
        "step time is the median over the last 2 epochs. Weights are compared after all steps;"
        f" tolerance {FLOAT32_TOLERANCE:g} (float32) and {MIXED_TOLERANCE:g} (`mixed_float16`) on the largest"
        " absolute difference.",
        "",
        "| backend | run | against | max weight difference | within tolerance | step time | step-time ratio"
        " | peak GPU memory |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for backend, result in report["backends"].items():
        lines += _backend_rows(backend, result)
    versions = "; ".join(f"{backend}: {result.get('versions', '-')}" for backend, result in report["backends"].items())
    lines += ["", f"Versions: {versions}.", ""]
    failures = [f"- {backend}: {problem}" for backend, r in report["backends"].items() for problem in r["problems"]]
    if failures:
        lines += ["Failures:", "", *failures, ""]
    return "\n".join(lines)


_AGAINST = {"dp1": "fit", "dp2": "dp1", "dp1_mixed": "fit_mixed"}
_LABELS = {
    "fit": "`model.fit`, 1 GPU",
    "dp1": "1 replica",
    "dp2": "2 replicas, 2 GPUs",
    "fit_mixed": "`model.fit`, mixed_float16",
    "dp1_mixed": "1 replica, mixed_float16",
}


def _backend_rows(backend: str, result: dict[str, Any]) -> list[str]:
    rows = []
    runs, comparisons = result["runs"], {c["name"]: c for c in result["comparisons"]}
    for case in CASES:
        run = runs.get(case)
        if run is None:
            continue
        if "skipped" in run:
            rows.append(f"| {backend} | {_LABELS[case]} | | {run['skipped']} | | | | |")
            continue
        against = _AGAINST.get(case)
        comparison = comparisons.get(case)
        difference = f"{comparison['max_difference']:.2e}" if comparison else ""
        within = ("yes" if comparison["ok"] else "**no**") if comparison else ""
        base = runs.get(against or "", {})
        ratio = f"{run['step_s'] / base['step_s']:.2f}x" if "step_s" in run and "step_s" in base else ""
        rows.append(
            f"| {backend} | {_LABELS[case]} | {_LABELS.get(against or '', '')} | {difference} | {within} |"
            f" {run['step_s'] * 1e3:.2f} ms | {ratio} | {run['peak_bytes'] / 2**20:.0f} MiB |"
        )
    return rows


# ---- the machine ------------------------------------------------------------------------


def nvidia_gpus() -> tuple[list[str], str, str]:
    """The NVIDIA GPUs' names, the driver version and the CUDA version the driver supports, from
    ``nvidia-smi`` (no GPU, or no driver: an empty list)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "", ""
    try:
        query = subprocess.run(
            [smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        header = subprocess.run([smi], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return [], "", ""
    rows = [line.split(",") for line in query.stdout.splitlines() if line.strip()] if query.returncode == 0 else []
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    return [row[0].strip() for row in rows], rows[0][1].strip() if rows else "", cuda.group(1) if cuda else "?"


def no_gpu_message(output: Path) -> str:
    return (
        "gpu_check: no NVIDIA GPU found (nvidia-smi is missing or lists none). This check needs a machine with "
        f"one or more NVIDIA GPUs and their driver; {output} was left as it is. Run `nox -s gpu` there."
    )


# ---- one run, in a process of its own ---------------------------------------------------


def _run_case(backend: str, case: str, steps: int, directory: Path) -> None:
    """Train the check's model as ``case`` says; write its weights, step time and peak memory."""
    import keras
    import numpy as np

    if case.endswith("_mixed"):
        keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * GLOBAL_BATCH_SIZE, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, size=len(x))
    _require_gpu(backend)
    model = _model()
    times = _epoch_timer()
    options = {"epochs": 3, "shuffle": False, "verbose": 0, "callbacks": [times]}
    if backend == "torch":
        import torch

        import torch_dp

        torch.cuda.reset_peak_memory_stats()
        if case.startswith("fit"):
            model.fit(x, y, batch_size=GLOBAL_BATCH_SIZE, **options)
        else:
            with torch_dp.Trainer(num_replicas=2 if case == "dp2" else 1) as trainer:
                trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH_SIZE, **options)
        peak = torch.cuda.max_memory_allocated()  # the caller's GPU: replica 0's
        versions = f"torch {torch.__version__} (CUDA {torch.version.cuda}), Keras {keras.__version__}"
    else:
        import jax

        import jax_dp

        device = jax.devices()[0]
        if case.startswith("fit"):
            model.fit(x, y, batch_size=GLOBAL_BATCH_SIZE, **options)
        else:
            trainer = jax_dp.Trainer(num_replicas=2 if case == "dp2" else 1)
            trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH_SIZE, **options)
        peak = max(int((d.memory_stats() or {}).get("peak_bytes_in_use", 0)) for d in jax.local_devices())
        versions = f"jax {jax.__version__} ({device.client.platform_version}), Keras {keras.__version__}"
    step_s = float(np.median(times.seconds[1:])) / steps
    np.savez(directory / f"{case}.npz", *[np.asarray(w, dtype=np.float32) for w in model.get_weights()])
    (directory / f"{case}.json").write_text(json.dumps({"step_s": step_s, "peak_bytes": peak, "versions": versions}))


def _require_gpu(backend: str) -> None:
    """A clear error when the backend's build cannot use the GPU that nvidia-smi lists."""
    if backend == "torch":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} sees no CUDA GPU (a CPU build?): install its CUDA wheel.")
        return
    import jax

    if jax.devices()[0].platform != "gpu":
        raise RuntimeError(f"jax {jax.__version__} sees no GPU (devices: {jax.devices()}): install jax[cuda12].")


def _model() -> Any:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _epoch_timer() -> Any:
    """A Keras callback that records seconds per epoch (it needs no per-batch logs, which would
    make every step wait for the GPU)."""
    import keras

    class EpochTimes(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.seconds: list[float] = []
            self._start = 0.0

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.seconds.append(time.perf_counter() - self._start)

    return EpochTimes()


# ---- the whole check --------------------------------------------------------------------


def _backend_results(backend: str, steps: int, num_gpus: int, directory: Path) -> dict[str, Any]:
    """Every case of ``backend``, each in its own process, and their comparisons."""
    import numpy as np

    runs: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    directory = directory / backend
    directory.mkdir()
    env = {**os.environ, "KERAS_BACKEND": backend, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    for case in CASES:
        if case == "dp2" and num_gpus < 2:
            runs[case] = {"skipped": f"needs 2 GPUs, this machine has {num_gpus}"}
            continue
        command = [sys.executable, __file__, "--run-case", backend, case, f"--steps={steps}", f"--dir={directory}"]
        print(f"gpu_check: {backend} {case} ...", flush=True)
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            problems.append(f"{_LABELS[case]} failed (exit {done.returncode}): {last}")
            continue
        runs[case] = json.loads((directory / f"{case}.json").read_text())
    comparisons = []
    for case, against in _AGAINST.items():
        if case in runs and against in runs and "skipped" not in runs[case]:
            tolerance = MIXED_TOLERANCE if case.endswith("_mixed") else FLOAT32_TOLERANCE
            weights, expected = (list(np.load(directory / f"{name}.npz").values()) for name in (case, against))
            comparison = compare_weights(case, weights, expected, tolerance)
            comparisons.append({"name": case, "max_difference": comparison.max_difference, "ok": comparison.ok})
            if not comparison.ok:
                problems.append(
                    f"{_LABELS[case]} vs {_LABELS[against]}: weights differ by up to {comparison.max_difference:.3g}"
                    f" (tolerance {tolerance:g})"
                )
    versions = next((run["versions"] for run in runs.values() if "versions" in run), "-")
    return {"runs": runs, "comparisons": comparisons, "problems": problems, "versions": versions}


def summary(report: dict[str, Any]) -> str:
    """What the terminal shows: each comparison and step-time ratio, then any failure."""
    lines = [f"GPU check, {report['date']}: {', '.join(report['machine']['gpus'])}"]
    for backend, result in report["backends"].items():
        runs = result["runs"]
        for comparison in result["comparisons"]:
            case = comparison["name"]
            against = _AGAINST[case]
            ratio = runs[case]["step_s"] / runs[against]["step_s"]
            verdict = "ok" if comparison["ok"] else "TOO FAR"
            lines.append(
                f"  {backend}: {_LABELS[case]} vs {_LABELS[against]}: weights within {comparison['max_difference']:.2e}"
                f" ({verdict}), step time {ratio:.2f}x, peak {runs[case]['peak_bytes'] / 2**20:.0f} MiB"
            )
        lines += [f"  {backend}: {problem}" for problem in result["problems"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A check for machines with NVIDIA GPUs (nox -s gpu).")
    parser.add_argument("--output", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument("--steps", type=int, default=30, help="steps per epoch")
    parser.add_argument("--backends", nargs="+", default=["torch", "jax"], choices=["torch", "jax"])
    parser.add_argument("--run-case", nargs=2, metavar=("BACKEND", "CASE"), help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_case:
        backend, case = args.run_case
        _run_case(backend, case, args.steps, args.dir)
        return 0
    gpus, driver, driver_cuda = nvidia_gpus()
    if not gpus:
        print(no_gpu_message(args.output), file=sys.stderr)
        return NO_GPU_EXIT
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"gpus": gpus, "driver": driver, "driver_cuda": driver_cuda},
        "steps": args.steps,
        "backends": {},
    }
    with tempfile.TemporaryDirectory() as directory:
        for backend in args.backends:
            report["backends"][backend] = _backend_results(backend, args.steps, len(gpus), Path(directory))
    print(summary(report))
    page = args.output.read_text() if args.output.exists() else "# Benchmarks\n"
    args.output.write_text(with_section(page, render_section(report)))
    print(f"wrote the {SECTION_HEADING[3:]} section of {args.output}")
    return 0 if not any(result["problems"] for result in report["backends"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
