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
    python benchmarks/bench_steps_per_execution.py --backend torch --output ...   # one backend, here

Each backend runs in a fresh process of this interpreter and writes its part of ``--output``; run
the torch part with an interpreter that has Keras 3.16 for ``model.fit``'s own groups on torch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from machine import round_order, usable_cores
from page_sections import write_section

BACKENDS = ("torch", "jax")
SIZES = (1, 8, 32)
FEATURES, CLASSES, GLOBAL_BATCH_SIZE = 20, 3, 64
ROWS = {"small": 16384, "convnet": 2048}
EPOCHS = 4  # the first holds compiling; the median of the others is the run's
# torch's ratios sit near 1 (both sides run the same kernels, a few tens of microseconds apart against a
# spread of several percent between runs): more rounds narrow its medians
ROUNDS = {"torch": 7, "jax": 3}


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
    """Each epoch's seconds, through epoch hooks only (no batch hook: the loops run as without one)."""

    def __init__(self) -> None:
        self.begins: list[float] = []
        self.seconds: list[float] = []

    def callback(self) -> Any:
        import keras

        return keras.callbacks.LambdaCallback(
            on_epoch_begin=lambda epoch, logs: self.begins.append(time.perf_counter()),
            on_epoch_end=lambda epoch, logs: self.seconds.append(time.perf_counter() - self.begins[-1]),
        )

    def ms_per_step(self, steps: int) -> float:
        return 1000 * statistics.median(self.seconds[1:]) / steps


def one_run(trainer: Any, name: str, size: int, x: np.ndarray, y: np.ndarray) -> float:
    """Milliseconds per step of one ``fit`` (``trainer`` None: ``model.fit``)."""
    build = convnet if name == "convnet" else small_model
    times = EpochTimes()
    arguments = {"epochs": EPOCHS, "callbacks": [times.callback()], "verbose": 0, "shuffle": False}
    if trainer is None:
        model = build(size if keras_groups_itself() else 1)
        model.fit(x, y, batch_size=GLOBAL_BATCH_SIZE, **arguments)
    else:
        trainer.fit(build(size), x, y, global_batch_size=GLOBAL_BATCH_SIZE, **arguments)
    return times.ms_per_step(ROWS[name] // GLOBAL_BATCH_SIZE)


def new_trainer(backend: str) -> Any:
    if backend == "torch":
        import torch_dp

        return torch_dp.Trainer(num_replicas=1)
    import jax_dp

    return jax_dp.Trainer(1)


def measure(backend: str, *, quick: bool) -> dict[str, Any]:
    trainer, results = new_trainer(backend), {}
    rounds = 1 if quick else ROUNDS[backend]
    try:
        for name in ("small", "convnet"):
            x, y = data(name)
            for size in SIZES:
                runs: dict[str, list[float]] = {"keras": [], "trainer": []}
                for index in range(rounds):
                    for who, contender in round_order({"keras": None, "trainer": trainer}, index):
                        runs[who].append(one_run(contender, name, size, x, y))
                ratios = [keras_ms / mine for keras_ms, mine in zip(runs["keras"], runs["trainer"], strict=True)]
                results[f"{name}/{size}"] = {
                    "ms_per_step": {who: statistics.median(values) for who, values in runs.items()},
                    "rounds_ms_per_step": runs,
                    "samples_per_s": {
                        who: 1000 * GLOBAL_BATCH_SIZE / statistics.median(values) for who, values in runs.items()
                    },
                    "median_ratio": statistics.median(ratios),
                    "ratios": ratios,
                }
                print(f"{backend} {name} N={size}: {results[f'{name}/{size}']['ms_per_step']} ratio {ratios}")
    finally:
        if backend == "torch":
            trainer.close()
    return results


def run_backend(backend: str, *, quick: bool, output: Path) -> None:
    import keras

    cores = usable_cores()
    results = measure(backend, quick=quick)
    document = json.loads(output.read_text()) if output.exists() else {}
    document["setup"] = {
        "rows": ROWS,
        "global_batch_size": GLOBAL_BATCH_SIZE,
        "steps_per_epoch": {name: rows // GLOBAL_BATCH_SIZE for name, rows in ROWS.items()},
        "epochs": EPOCHS,
        "sizes": list(SIZES),
    }
    document["host"] = {"machine": platform.machine(), "cpu_count": os.cpu_count(), "python": platform.python_version()}
    document[backend] = {
        "keras": keras.__version__,
        "keras_steps_per_execution": "N" if keras_groups_itself() else "1 (this Keras's torch model.fit refuses N > 1)",
        "usable_cores_before": cores,
        "rounds": 1 if quick else ROUNDS[backend],
        "results": results,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2) + "\n")


HEADING = "## steps_per_execution: a Trainer against model.fit"
MODELS = {"small": "the small model", "convnet": "the guide's convnet"}


def section(document: dict[str, Any], source: str) -> str:
    """The page's section from ``document`` (what ``--output`` holds)."""
    lines = [
        HEADING,
        "",
        f"Written by `benchmarks/bench_steps_per_execution.py` into `{source}`. One device on each side (a",
        "Trainer of one replica against `model.fit`, the same work), at a global batch of "
        f"{document['setup']['global_batch_size']} (steps an epoch: {document['setup']['steps_per_epoch']}),",
        f"medians over interleaved rounds ({_rounds(document)}) of each run's median epoch after the first.",
        "Ratio: `model.fit`'s time per step over the Trainer's (at least 1: the Trainer is as fast or faster).",
        "",
        "| backend (Keras) | model | N | model.fit ms/step | Trainer ms/step | Trainer samples/s | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for backend in BACKENDS:
        if backend not in document:
            continue
        part = document[backend]
        label = f"{backend} ({part['keras']}; model.fit N: {part['keras_steps_per_execution']})"
        for key, measured in part["results"].items():
            name, size = key.split("/")
            ms = measured["ms_per_step"]
            lines.append(
                f"| {label} | {MODELS[name]} | {size} | {ms['keras']:.3f} | {ms['trainer']:.3f} | "
                f"{measured['samples_per_s']['trainer']:.0f} | {measured['median_ratio']:.2f}x |"
            )
    cores = ", ".join(
        f"{backend} {document[backend]['usable_cores_before']:.2f}" for backend in BACKENDS if backend in document
    )
    lines += [
        "",
        f"Usable cores of 2 before each backend's runs (`benchmarks/machine.py`): {cores}.",
        *_below_one(document),
        *_keras_slower_grouped(document),
    ]
    return "\n".join(lines) + "\n"


def _rounds(document: dict[str, Any]) -> str:
    return ", ".join(f"{backend} {document[backend]['rounds']}" for backend in BACKENDS if backend in document)


def _keras_slower_grouped(document: dict[str, Any]) -> list[str]:
    """A line on each setting where ``model.fit`` itself is over twice as slow per step grouped as at N = 1:
    the ratio there is Keras's loop's, not the Trainer's gain."""
    lines = []
    for backend in BACKENDS:
        results = document.get(backend, {}).get("results", {})
        for key, measured in results.items():
            name, size = key.split("/")
            alone, grouped = results[f"{name}/1"]["ms_per_step"], measured["ms_per_step"]
            if size == "1" or grouped["keras"] < 2 * alone["keras"]:
                continue
            lines.append(
                f"- model.fit slower grouped: {backend}, {MODELS[name]}, N={size}: model.fit's time per step goes "
                f"from {alone['keras']:.3f} ms at N=1 to {grouped['keras']:.3f} (Keras's own loop, measured as it "
                f"is; the Trainer's from {alone['trainer']:.3f} to {grouped['trainer']:.3f}), so its "
                f"{measured['median_ratio']:.2f}x is not the Trainer's gain."
            )
    return ["", *lines] if lines else []


def _below_one(document: dict[str, Any]) -> list[str]:
    """A line on each setting below 1.0x, with what the same file says of it: whether N = 1 is below
    too (the Trainer's own work per step, which grouping does not remove)."""
    lines = []
    for backend in BACKENDS:
        results = document.get(backend, {}).get("results", {})
        for key, measured in results.items():
            name, size = key.split("/")
            if measured["median_ratio"] >= 1.0:
                continue
            alone = results[f"{name}/1"]
            rounds = ", ".join(f"{ratio:.2f}" for ratio in measured["ratios"])
            if size == "1":
                lines.append(
                    f"- Shortfall: {backend}, {MODELS[name]}, N=1: {measured['median_ratio']:.2f}x ({rounds}"
                    f"{_spread(measured['ratios'])})."
                )
                continue
            lines.append(
                f"- Shortfall: {backend}, {MODELS[name]}, N={size}: {measured['median_ratio']:.2f}x ({rounds}"
                f"{_spread(measured['ratios'])}). "
                f"At N=1 the same model is {alone['median_ratio']:.2f}x and the Trainer's time per step goes "
                f"from {alone['ms_per_step']['trainer']:.3f} to {measured['ms_per_step']['trainer']:.3f} ms "
                f"at N={size} "
                f"(model.fit's from {alone['ms_per_step']['keras']:.3f} to {measured['ms_per_step']['keras']:.3f})."
            )
    return ["", *lines] if lines else []


def _spread(ratios: list[float]) -> str:
    """Said when some round reached 1.0x: the median's shortfall is within the rounds' spread."""
    return "; some rounds at 1.0x or above: within the spread between rounds" if max(ratios) >= 1.0 else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: one round")
    parser.add_argument("--output", type=Path, default=Path("docs/benchmarks/steps_per_execution.json"))
    parser.add_argument("--backend", choices=BACKENDS, help="measure only this backend, in this process")
    parser.add_argument("--python", default=sys.executable, help="the interpreter of each backend's process")
    parser.add_argument("--page", action="store_true", help="only write docs/benchmarks.md's section from --output")
    args = parser.parse_args()
    if args.page:
        write_section(HEADING, section(json.loads(args.output.read_text()), str(args.output)))
        return
    if args.backend is not None:
        run_backend(args.backend, quick=args.quick, output=args.output)
        return
    for backend in BACKENDS:
        environment = dict(os.environ, KERAS_BACKEND=backend, XLA_FLAGS="--xla_force_host_platform_device_count=1")
        command = [args.python, __file__, "--backend", backend, "--output", str(args.output)]
        subprocess.run(command + (["--quick"] if args.quick else []), check=True, env=environment)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
