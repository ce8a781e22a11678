"""``compile(steps_per_execution=N)``: what a group of steps saves, a Trainer against ``model.fit``.

For N in 1, 8 and 32, on the interactive benchmark's small model (20 features -> Dense(64) ->
Dense(3), 16,384 rows at a global batch of 64: 256 steps an epoch, nearly all of a step's time the
host's, so that what a loop does once an epoch weighs little) and on the Keras guide's MNIST
convnet (2,048 random MNIST-shaped rows, batch 64: 32 steps an epoch), on one
device each, so both sides do the same work: ``model.fit`` against a Trainer of one replica
(``torch_dp.Trainer(num_replicas=1)``, ``jax_dp.Trainer(1)``). Interleaved rounds, the order
reversed every other round; each run's milliseconds per step from its median epoch after the first
(the first holds compiling); the ratio is the median over rounds of ``model.fit``'s time over the
Trainer's (above 1: the Trainer is faster). Where Keras's own loop refuses N > 1 (torch before
Keras 3.16) ``model.fit`` runs N = 1, said in the output (``keras_steps_per_execution``).

    python benchmarks/bench_steps_per_execution.py [--quick] --output docs/benchmarks/steps_per_execution.json
    python benchmarks/bench_steps_per_execution.py --backend torch --output ...   # one backend

Every run's process holds glibc's malloc to the same settings (``QUIET_MALLOC``), both sides
alike: with glibc's defaults, which of a step's buffers go back to the kernel after the step (to be
mapped and zeroed again, one page fault a page, at the next) changes with the process's history, and
moved the convnet's steps on torch by up to a third between runs of the same code; the page shows
what those defaults give on one setting of each backend (``DEFAULT_MALLOC``). Each backend's rounds run in fresh
processes of this interpreter (torch's in several: a process's own layout moves both sides' steps
by a few percent), each writing its runs into a part file that ``--output`` gathers; run the torch
part with an interpreter that has Keras 3.16 for ``model.fit``'s own groups on torch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from machine import round_order, usable_cores
from page_sections import write_section
from steps_per_execution_page import HEADING, section

BACKENDS = ("torch", "jax")
SIZES = (1, 8, 32)
FEATURES, CLASSES, GLOBAL_BATCH_SIZE = 20, 3, 64
ROWS = {"small": 16384, "convnet": 2048}
EPOCHS = 4  # the first holds compiling; the median of the others is the run's
# torch's ratios sit near 1 (both sides run the same kernels, a few tens of microseconds apart against a
# spread of several percent between runs): more rounds, in several processes, narrow its medians
PROCESSES = {"torch": 3, "jax": 1}
ROUNDS = {"torch": 4, "jax": 3}  # in each process
# Every buffer from the heap (none mapped on its own, which glibc does by default for a buffer of
# 128 KiB or more, up to 32 MiB as a process runs: XLA's temporary buffer for a step of the convnet is
# 58 MB), up to 1 GiB of the heap's free top kept, and the heap grown 256 MiB at a time: a step's
# freed buffers serve the next step instead of going back to the kernel, which would zero every page
# of them again (glibc's own mallopt settings, as environment variables)
QUIET_MALLOC = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
    "MALLOC_TOP_PAD_": str(256 << 20),
}
DEFAULT_MALLOC = ("convnet/1", 3)  # the setting and rounds each backend runs once more under glibc's defaults


def small_model(size: int) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(CLASSES, activation="softmax"),
        ]
    )
    model.compile(
        optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"], steps_per_execution=size
    )
    return model


def convnet(size: int) -> Any:
    from guide_convnet import mnist_convnet

    model = mnist_convnet()
    model.compile(
        optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"], steps_per_execution=size
    )
    return model


def data(name: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    if name == "convnet":
        from guide_convnet import synthetic_mnist

        return synthetic_mnist(ROWS[name])
    rows = ROWS[name]
    return rng.standard_normal((rows, FEATURES), dtype=np.float32), rng.integers(0, CLASSES, rows).astype("int64")


def keras_groups_itself() -> bool:
    import keras

    major, minor = (int(part) for part in keras.version().split(".")[:2])
    return keras.backend.backend() != "torch" or (major, minor) >= (3, 16)


class EpochTimes:
    """Each epoch's seconds and the process's page faults meanwhile, through epoch hooks only (no batch
    hook: the loops run as without one)."""

    def __init__(self) -> None:
        self.begins: list[tuple[float, int]] = []
        self.seconds: list[float] = []
        self.faults: list[int] = []

    def callback(self) -> Any:
        import keras

        return keras.callbacks.LambdaCallback(on_epoch_begin=self._begin, on_epoch_end=self._end)

    def _begin(self, epoch: int, logs: Any) -> None:
        self.begins.append((time.perf_counter(), _minor_faults()))

    def _end(self, epoch: int, logs: Any) -> None:
        began, faults = self.begins[-1]
        self.seconds.append(time.perf_counter() - began)
        self.faults.append(_minor_faults() - faults)

    def run(self, steps: int) -> dict[str, float]:
        """The run's median epoch after the first (the first holds compiling), per step."""
        return {
            "ms_per_step": 1000 * statistics.median(self.seconds[1:]) / steps,
            "faults_per_step": statistics.median(self.faults[1:]) / steps,
        }


def _minor_faults() -> int:
    """Pages this process has touched for the first time since it started (each one zeroed by the kernel)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def one_run(trainer: Any, name: str, size: int, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Milliseconds and page faults per step of one ``fit`` (``trainer`` None: ``model.fit``)."""
    build = convnet if name == "convnet" else small_model
    times = EpochTimes()
    arguments = {"epochs": EPOCHS, "callbacks": [times.callback()], "verbose": 0, "shuffle": False}
    if trainer is None:
        model = build(size if keras_groups_itself() else 1)
        model.fit(x, y, batch_size=GLOBAL_BATCH_SIZE, **arguments)
    else:
        trainer.fit(build(size), x, y, global_batch_size=GLOBAL_BATCH_SIZE, **arguments)
    return times.run(ROWS[name] // GLOBAL_BATCH_SIZE)


def new_trainer(backend: str) -> Any:
    if backend == "torch":
        import torch_dp

        return torch_dp.Trainer(num_replicas=1)
    import jax_dp

    return jax_dp.Trainer(1)


def measure(backend: str, settings: list[str], rounds: int) -> dict[str, dict[str, list[dict[str, float]]]]:
    """Each setting's (``"convnet/8"``) runs, interleaved rounds, by contender."""
    trainer, runs = new_trainer(backend), {}
    try:
        for setting in settings:
            name, size = setting.split("/")
            x, y = data(name)
            runs[setting] = {"keras": [], "trainer": []}
            for index in range(rounds):
                for who, contender in round_order({"keras": None, "trainer": trainer}, index):
                    runs[setting][who].append(one_run(contender, name, int(size), x, y))
            print(f"{backend} {setting}: {runs[setting]}", flush=True)
    finally:
        if backend == "torch":
            trainer.close()
    return runs


def measure_part(backend: str, settings: list[str], rounds: int, part: Path) -> None:
    """One process's runs, into ``part``."""
    import keras

    cores = usable_cores()
    document = {
        "keras": keras.__version__,
        "keras_steps_per_execution": "N" if keras_groups_itself() else "1 (this Keras's torch model.fit refuses N > 1)",
        "usable_cores_before": cores,
        "malloc": {name: os.environ.get(name) for name in QUIET_MALLOC},
        "runs": measure(backend, settings, rounds),
    }
    part.write_text(json.dumps(document, indent=2) + "\n")


def summary(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """A setting's medians and ratios over its rounds (the ratio: ``model.fit``'s time over the Trainer's)."""
    ms = {who: [run["ms_per_step"] for run in values] for who, values in runs.items()}
    ratios = [keras_ms / mine for keras_ms, mine in zip(ms["keras"], ms["trainer"], strict=True)]
    return {
        "ms_per_step": {who: statistics.median(values) for who, values in ms.items()},
        "rounds_ms_per_step": ms,
        "faults_per_step": {who: [run["faults_per_step"] for run in values] for who, values in runs.items()},
        "samples_per_s": {who: 1000 * GLOBAL_BATCH_SIZE / statistics.median(values) for who, values in ms.items()},
        "median_ratio": statistics.median(ratios),
        "ratios": ratios,
    }


def run_backend(backend: str, *, quick: bool, python: str, output: Path) -> None:
    """``backend``'s processes (and the run under glibc's defaults), gathered into ``output``."""
    settings = [f"{name}/{size}" for name in ROWS for size in SIZES]
    processes, rounds = (1, 1) if quick else (PROCESSES[backend], ROUNDS[backend])
    parts = [
        _process(backend, settings, rounds, python, output, f"part{index}", QUIET_MALLOC) for index in range(processes)
    ]
    gathered: dict[str, dict[str, list[dict[str, float]]]] = {}
    for part in parts:
        for setting, runs in part["runs"].items():
            for who, values in runs.items():
                gathered.setdefault(setting, {}).setdefault(who, []).extend(values)
    document = json.loads(output.read_text()) if output.exists() else {}
    document["setup"] = {
        "rows": ROWS,
        "global_batch_size": GLOBAL_BATCH_SIZE,
        "steps_per_epoch": {name: rows // GLOBAL_BATCH_SIZE for name, rows in ROWS.items()},
        "epochs": EPOCHS,
        "sizes": list(SIZES),
        "malloc": QUIET_MALLOC,
    }
    document["host"] = {"machine": platform.machine(), "cpu_count": os.cpu_count(), "python": platform.python_version()}
    document[backend] = {
        "keras": parts[0]["keras"],
        "keras_steps_per_execution": parts[0]["keras_steps_per_execution"],
        "usable_cores_before": min(part["usable_cores_before"] for part in parts),
        "processes": processes,
        "rounds": processes * rounds,
        "results": {setting: summary(runs) for setting, runs in gathered.items()},
    }
    setting, default_rounds = DEFAULT_MALLOC
    if not quick:
        part = _process(backend, [setting], default_rounds, python, output, "defaults", {})
        document[backend]["glibc_defaults"] = {"setting": setting, **summary(part["runs"][setting])}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2) + "\n")


def _process(
    backend: str, settings: list[str], rounds: int, python: str, output: Path, name: str, malloc: dict[str, str]
) -> dict[str, Any]:
    """One fresh process's runs (``malloc``: its glibc settings; empty: glibc's defaults)."""
    part = output.with_name(f"{output.stem}.{backend}.{name}.json")
    environment = {key: value for key, value in os.environ.items() if key not in QUIET_MALLOC}
    environment |= {"KERAS_BACKEND": backend, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", **malloc}
    command = [python, __file__, "--measure", backend, "--settings", ",".join(settings), "--rounds", str(rounds)]
    subprocess.run([*command, "--part", str(part)], check=True, env=environment)
    document = json.loads(part.read_text())
    part.unlink()
    return document


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: one round in one process")
    parser.add_argument("--output", type=Path, default=Path("docs/benchmarks/steps_per_execution.json"))
    parser.add_argument("--backend", choices=BACKENDS, help="measure only this backend")
    parser.add_argument("--python", default=sys.executable, help="the interpreter of each backend's processes")
    parser.add_argument("--page", action="store_true", help="only write docs/benchmarks.md's section from --output")
    parser.add_argument("--measure", choices=BACKENDS, help=argparse.SUPPRESS)  # one process's part
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--part", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.page:
        write_section(HEADING, section(json.loads(args.output.read_text()), str(args.output)))
        return
    if args.measure is not None:
        measure_part(args.measure, args.settings.split(","), args.rounds, args.part)
        return
    for backend in [args.backend] if args.backend else BACKENDS:
        run_backend(backend, quick=args.quick, python=args.python, output=args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
