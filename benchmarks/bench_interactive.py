"""Interactive speed on 2 CPU replicas: how long each ``fit``, ``evaluate`` and ``predict`` call
takes when a user calls them one after the other, and what a batch-level callback costs.

The model is small on purpose (20 features -> Dense(64, relu) -> Dense(3, softmax), adam,
accuracy; 2,000 rows at a global batch of 64), so the time is the trainer's, not the model's.
For each backend, in its own process (torch: ``torch_dp.Trainer(num_replicas=2)``, the caller
as rank 0 and one worker; jax: ``jax_dp.Trainer(2)`` on 2 forced host devices):

- ``calls``: the cycle ``fit`` (4 epochs) -> ``evaluate`` -> ``predict``, 3 times on one model,
  by plain Keras (``model.fit`` ..., one process) and by one Trainer; the first cycle of the
  Trainer starts its workers (torch) or compiles its steps (jax). ``evaluate`` and ``predict``
  are also timed as the first call of a new Trainer. Seconds from the call to its return.
- ``first_step_s`` of each ``fit``: from the call until its steps run at steady speed, i.e. the
  end of the first epoch less the shortest later epoch. Measured with epoch-level hooks
  only, because a batch-level hook is itself what the last measure is about (it makes both
  loops bring logs to the caller at every step).
- ``throughput``: samples/s of ``fit`` on the Trainer above (workers started, steps compiled)
  with and without a batch-level callback that only reads the logs,
  ``LambdaCallback(on_train_batch_end=lambda batch, logs: logs["loss"])``, in interleaved rounds
  (the order reversed every other round), each run's samples/s from its median epoch after the
  first; the ratio is the median over rounds of each round's ratio. Plain ``model.fit`` is
  measured the same way, for what the callback costs in Keras itself. So is the Keras progress bar
  (``verbose=1``, its lines sent to ``os.devnull``), a batch-level callback every terminal user has.
  On jax, ``bare_step``: the same model's bare jitted step waiting for every step's loss, over
  back to back (``jax_bare_step``), the floor under any loop that hands each step's logs to the
  host. ``per_step``: in the
  same runs, milliseconds per step of the step and of the parts of the Trainer's loop (in this
  process) that a batch callback adds, timed by wrappers (``trainer_parts``); medians over rounds.

    python benchmarks/bench_interactive.py [--quick] --output docs/benchmarks/interactive.json
    python benchmarks/bench_interactive.py --backend torch   # one backend again, in this process

Without ``--backend`` each backend runs in a fresh process of this interpreter (Keras picks its
backend, and jax its device count, once per process); each writes its part of ``--output``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from machine import round_order, usable_cores

BACKENDS = ("torch", "jax")
NUM_REPLICAS = 2
ROWS, FEATURES, CLASSES = 2000, 20, 3
GLOBAL_BATCH_SIZE = 64
STEPS_PER_EPOCH = math.ceil(ROWS / GLOBAL_BATCH_SIZE)  # the last one padded and masked
FIT_EPOCHS = 4  # the first epoch holds the start-up; the others say how long an epoch takes
CYCLES = 3  # fit -> evaluate -> predict, on one model
JAX_XLA_FLAGS = f"--xla_force_host_platform_device_count={NUM_REPLICAS}"
ROUND_SECONDS = 1.5  # each throughput run lasts about this long


def _environment_for(backend: str) -> dict[str, str]:
    """What must be set before Keras (and jax) are imported."""
    environment = {"KERAS_BACKEND": backend}
    if backend == "jax":  # the caller's other XLA flags kept, its device count replaced
        flags = os.environ.get("XLA_FLAGS", "").split()
        kept = [flag for flag in flags if not flag.startswith("--xla_force_host_platform_device_count=")]
        environment["XLA_FLAGS"] = " ".join([*kept, JAX_XLA_FLAGS])
    return environment


def synthetic_rows() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, FEATURES), dtype=np.float32)
    return x, rng.integers(0, CLASSES, ROWS).astype("int64")


def dense_model() -> Any:
    """The small Dense classifier, compiled, seeded so every model starts from the same weights."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(CLASSES, activation="softmax"),
        ]
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class EpochClock:
    """``time.perf_counter()`` at each epoch's begin and end, through a ``LambdaCallback`` with
    epoch hooks only, so that the loops run as they do for a ``fit`` without callbacks."""

    def __init__(self) -> None:
        self.begins: list[float] = []
        self.ends: list[float] = []

    def callback(self) -> Any:
        import keras

        return keras.callbacks.LambdaCallback(
            on_epoch_begin=lambda epoch, logs: self.begins.append(time.perf_counter()),
            on_epoch_end=lambda epoch, logs: self.ends.append(time.perf_counter()),
        )

    def epoch_seconds(self) -> list[float]:
        return [end - begin for begin, end in zip(self.begins, self.ends, strict=True)]

    def first_step_s(self, called: float) -> float:
        """From the call until the steps run at steady speed: the first epoch's end less the
        shortest later epoch (more, not less, than the start-up, unless the first epoch's own
        steps ran faster than every later epoch)."""
        return self.ends[0] - called - min(self.epoch_seconds()[1:])

    def samples_per_s(self) -> float:
        """Over the median epoch after the first (a moment's load elsewhere skews one epoch, not the run)."""
        return ROWS / statistics.median(self.epoch_seconds()[1:])


class Calls:
    """``fit``/``evaluate``/``predict`` of plain Keras or of a Trainer, with the same arguments."""

    def __init__(self, trainer: Any = None) -> None:
        self.trainer = trainer

    def fit(
        self, model: Any, x: np.ndarray, y: np.ndarray, epochs: int, callbacks: list[Any], verbose: int = 0
    ) -> None:
        if self.trainer is None:
            model.fit(x, y, batch_size=GLOBAL_BATCH_SIZE, epochs=epochs, callbacks=callbacks, verbose=verbose)
        else:
            self.trainer.fit(
                model, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=epochs, callbacks=callbacks, verbose=verbose
            )

    def evaluate(self, model: Any, x: np.ndarray, y: np.ndarray) -> None:
        if self.trainer is None:
            model.evaluate(x, y, batch_size=GLOBAL_BATCH_SIZE, verbose=0)
        else:
            self.trainer.evaluate(model, x, y, global_batch_size=GLOBAL_BATCH_SIZE, verbose=0)

    def predict(self, model: Any, x: np.ndarray) -> None:
        if self.trainer is None:
            model.predict(x, batch_size=GLOBAL_BATCH_SIZE, verbose=0)
        else:
            self.trainer.predict(model, x, global_batch_size=GLOBAL_BATCH_SIZE, verbose=0)


def _seconds(call: Callable[[], None]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def cycles(calls: Calls, model: Any, x: np.ndarray, y: np.ndarray, count: int) -> dict[str, list[Any]]:
    """``count`` cycles of fit -> evaluate -> predict on ``model``: each call's seconds, each
    fit's time to its first step and the length of each of its epochs."""
    seconds: dict[str, list[float]] = {"fit": [], "evaluate": [], "predict": [], "fit_first_step": []}
    epoch_seconds = []
    for _ in range(count):
        clock = EpochClock()
        called = time.perf_counter()
        calls.fit(model, x, y, FIT_EPOCHS, [clock.callback()])
        seconds["fit"].append(time.perf_counter() - called)
        seconds["fit_first_step"].append(clock.first_step_s(called))
        epoch_seconds.append(clock.epoch_seconds())
        seconds["evaluate"].append(_seconds(lambda: calls.evaluate(model, x, y)))
        seconds["predict"].append(_seconds(lambda: calls.predict(model, x)))
    return {**seconds, "fit_epoch_s": epoch_seconds}


def logs_only_callback() -> Any:
    import keras

    return keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: logs["loss"])


class PartTimers:
    """Seconds spent in chosen functions (``part: (owner, attribute name)``), through wrappers
    installed while in a ``with`` block. A wrapper costs about a microsecond a call."""

    def __init__(self, parts: dict[str, tuple[Any, str]]) -> None:
        self.parts = parts
        self.seconds = dict.fromkeys(parts, 0.0)
        self._originals = {part: getattr(owner, name) for part, (owner, name) in parts.items()}

    def __enter__(self) -> PartTimers:
        for part, (owner, name) in self.parts.items():
            setattr(owner, name, self._timed(part))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for part, (owner, name) in self.parts.items():
            setattr(owner, name, self._originals[part])

    def _timed(self, part: str) -> Callable[..., Any]:
        original = self._originals[part]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        return wrapper

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.parts, 0.0)


def throughput(
    calls: Calls, model: Any, x: np.ndarray, y: np.ndarray, rounds: int, parts: dict[str, tuple[Any, str]]
) -> dict[str, Any]:
    """Samples/s of ``fit`` without and with a logs-only batch callback, interleaved rounds; and
    in the same runs, milliseconds per step of the step and of each of ``parts``."""
    timers = PartTimers(parts)

    def run(epochs: int, callbacks: list[Any], verbose: int = 0) -> tuple[float, dict[str, float]]:
        clock = EpochClock()
        timers.reset()
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):  # the progress bar's lines
            calls.fit(model, x, y, epochs, [clock.callback(), *callbacks], verbose)
        steps = STEPS_PER_EPOCH * epochs
        step_ms = 1000 * statistics.median(clock.epoch_seconds()[1:]) / STEPS_PER_EPOCH
        return clock.samples_per_s(), {"step_ms": step_ms, **{p: 1000 * t / steps for p, t in timers.seconds.items()}}

    contenders = {
        "without": lambda epochs: run(epochs, []),
        "with": lambda epochs: run(epochs, [logs_only_callback()]),
        "progress_bar": lambda epochs: run(epochs, [], verbose=1),
    }
    samples_per_s: dict[str, list[float]] = {name: [] for name in contenders}
    per_step: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
    cores = []
    with timers:
        # A warm-up (on jax a batch-level callback needs a train step of its own), which also
        # says how long an epoch lasts.
        epoch_s = max(ROWS / contender(3)[0] for contender in contenders.values())
        epochs = max(3, math.ceil(ROUND_SECONDS / epoch_s) + 1)
        for round_index in range(rounds):
            cores.append(usable_cores())
            for name, contender in round_order(contenders, round_index):
                measured, per_part = contender(epochs)
                samples_per_s[name].append(measured)
                per_step[name].append(per_part)
    ratios = [a / b for a, b in zip(samples_per_s["with"], samples_per_s["without"], strict=True)]
    bar = [a / b for a, b in zip(samples_per_s["progress_bar"], samples_per_s["without"], strict=True)]
    return {
        "progress_bar_ratio_per_round": bar,
        "progress_bar_median_ratio": statistics.median(bar),
        "epochs_per_run": epochs,
        "usable_cores": cores,
        "samples_per_s": samples_per_s,
        "ratio_per_round": ratios,
        "median_ratio": statistics.median(ratios),
        "per_step": {
            name: {part: statistics.median(parts_of_run[part] for parts_of_run in runs) for part in runs[0]}
            for name, runs in per_step.items()
        },
    }


def trainer_parts(backend: str) -> dict[str, tuple[Any, str]]:
    """What a batch callback adds to a Trainer's loop, timed per step in this process.
    ``callbacks_ms``: Keras's ``CallbackList`` batch-end hook (without a batch callback it hands
    each call to a thread). ``trainer_logs_ms``: a step's results turned into the logs a batch
    callback gets (torch_dp's rank 0 computes them from the metric states summed over the
    replicas; jax_dp copies them from the devices, waiting for the step). ``train_step_ms``:
    torch_dp's whole step on rank 0, its all-reduce included."""
    import keras

    parts = {"callbacks_ms": (keras.callbacks.CallbackList, "on_train_batch_end")}
    if backend == "torch":
        from torch_dp._loop import epochs as _loop

        return {**parts, "trainer_logs_ms": (_loop, "logs_of"), "train_step_ms": (_loop, "train_step")}
    from jax_dp._loop import epochs as _epochs

    return {**parts, "trainer_logs_ms": (_epochs, "report_on_host")}


def _versions(backend: str) -> dict[str, str]:
    import keras

    if backend == "torch":
        import torch

        import torch_dp

        return {"keras": keras.__version__, "torch": torch.__version__, "torch_dp": torch_dp.__version__}
    import jax

    import jax_dp

    return {"keras": keras.__version__, "jax": jax.__version__, "jax_dp": jax_dp.__version__}


def _threads(backend: str) -> int | None:
    """The caller's torch threads, which plain Keras on torch uses (jax's CPU threads are XLA's own)."""
    if backend != "torch":
        return None
    import torch

    return torch.get_num_threads()


def _new_trainer(backend: str) -> Any:
    if backend == "torch":
        import torch_dp

        return torch_dp.Trainer(num_replicas=NUM_REPLICAS)
    import jax_dp

    return jax_dp.Trainer(NUM_REPLICAS)


def _close(backend: str, trainer: Any) -> None:
    if backend == "torch":  # its worker processes; a jax_dp Trainer holds none
        trainer.close()


def _warm_up_process(x: np.ndarray, y: np.ndarray) -> None:
    """Once per process (imports, first kernels), so that no first call measured pays for it."""
    model, rows = dense_model(), slice(0, GLOBAL_BATCH_SIZE)
    Calls().fit(model, x[rows], y[rows], 1, [])
    Calls().evaluate(model, x[rows], y[rows])
    Calls().predict(model, x[rows])


def _first_call_of_new_trainers(backend: str, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """``evaluate`` and ``predict`` as the first call of a new Trainer, each on a new model."""
    first_calls = {
        "evaluate": lambda calls, model: calls.evaluate(model, x, y),
        "predict": lambda calls, model: calls.predict(model, x),
    }
    seconds = {}
    for name, first_call in first_calls.items():
        trainer, model = _new_trainer(backend), dense_model()
        try:
            start = time.perf_counter()
            first_call(Calls(trainer), model)
            seconds[name] = time.perf_counter() - start
        finally:
            _close(backend, trainer)
    return seconds


def measure(backend: str, *, quick: bool) -> dict[str, Any]:
    """Every measure of one backend, in this process (which must not have imported Keras yet)."""
    if "keras" in sys.modules:
        raise RuntimeError("bench_interactive measures a backend in a process that has not imported Keras yet.")
    environment = _environment_for(backend)
    os.environ.update(environment)
    load, cores = os.getloadavg(), usable_cores()
    x, y = synthetic_rows()
    rounds = 1 if quick else 7
    _warm_up_process(x, y)
    print(f"{backend}: plain Keras", flush=True)
    keras_model = dense_model()
    keras_calls = cycles(Calls(), keras_model, x, y, CYCLES)
    print(f"{backend}: the first call of a new Trainer", flush=True)
    new_trainer = _first_call_of_new_trainers(backend, x, y)
    print(f"{backend}: Trainer({NUM_REPLICAS}) cycles and throughput", flush=True)
    trainer = _new_trainer(backend)
    try:
        model = dense_model()
        trainer_calls = cycles(Calls(trainer), model, x, y, CYCLES)
        new_trainer["fit"] = trainer_calls["fit"][0]
        new_trainer["fit_first_step"] = trainer_calls["fit_first_step"][0]
        trainer_throughput = throughput(Calls(trainer), model, x, y, rounds, trainer_parts(backend))
    finally:
        _close(backend, trainer)
    keras_throughput = throughput(Calls(), keras_model, x, y, rounds, {})
    if backend == "jax":  # the floor under a batch callback's cost: a bare step waiting for every step
        from jax_bare_step import sync_cost

        trainer_throughput["bare_step"] = sync_cost(  # twice the rounds: its runs are short and spread more
            dense_model(), x, y, batch_size=GLOBAL_BATCH_SIZE, rounds=2 * rounds, seconds=ROUND_SECONDS
        )
    return {
        "quick": quick,
        "versions": _versions(backend),
        "load_average_at_start": list(load),
        "usable_cores_at_start": cores,
        "environment": environment,
        "keras_threads": _threads(backend),
        "keras": keras_calls,
        "trainer": trainer_calls,
        "new_trainer": new_trainer,
        "throughput": {"trainer": trainer_throughput, "keras": keras_throughput},
    }


def _print_summary(backend: str, results: dict[str, Any]) -> None:
    for who in ("keras", "trainer"):
        for call in ("fit", "fit_first_step", "evaluate", "predict"):
            print(f"{backend} {who:>8} {call:>15}: " + " ".join(f"{s:6.3f}" for s in results[who][call]))
    print(f"{backend} new trainer: {results['new_trainer']}")
    for who, measured in results["throughput"].items():
        print(f"{backend} {who}: with/without a batch callback {measured['median_ratio']:.3f}x {measured}")


def run_backend(backend: str, *, quick: bool, output: Path) -> None:
    """Measure ``backend`` here and write it into ``output`` (the other backend's part is kept)."""
    results = measure(backend, quick=quick)
    _print_summary(backend, results)
    document = json.loads(output.read_text()) if output.exists() else {}
    document.update(
        {
            "setup": {
                "model": f"{FEATURES} features -> Dense(64, relu) -> Dense({CLASSES}, softmax), adam, accuracy",
                "rows": ROWS,
                "global_batch_size": GLOBAL_BATCH_SIZE,
                "num_replicas": NUM_REPLICAS,
                "fit_epochs": FIT_EPOCHS,
                "round_seconds": ROUND_SECONDS,
            },
            "host": {"machine": platform.machine(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
            backend: results,
        }
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: one throughput round")
    parser.add_argument("--output", type=Path, default=Path("docs/benchmarks/interactive.json"))
    parser.add_argument("--backend", choices=BACKENDS, help="measure only this backend, in this process")
    args = parser.parse_args()
    if args.backend is not None:
        run_backend(args.backend, quick=args.quick, output=args.output)
        return
    if args.output.exists():
        args.output.unlink()  # no part of an earlier run survives a failed one
    for backend in BACKENDS:
        command = [sys.executable, __file__, "--backend", backend, "--output", str(args.output)]
        subprocess.run(command + (["--quick"] if args.quick else []), check=True)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
