"""keras-dp's main job, end to end: data-parallel training on real data, checked for exactness.

    python examples/demo.py [--backend torch|jax] [--replicas N | --mesh RxC] [--epochs E] [--output DIR]

Trains the digits convnet of ``digits_<backend>.py`` on N replicas and on 1 replica from the
same initial weights and data order. With ``--mesh RxC`` (jax), the first run is model
parallel instead: R replicas, each a row of C devices that split the convolutions' filters and
the Dense layer's kernel between them (``MESH_LAYOUT``). Prints the held-out accuracy, the throughput and the
exactness check (the largest weight difference between the two trained models), and writes
a PNG of both runs' loss and accuracy curves.

The 1-replica run is the reference of the speedup, so it runs on the threads each of the N
replicas gets (``dp_core.threads_per_replica``): torch's default for one process is every core,
and on a small or busy CPU that makes its steps slower, and the speedup one that cannot be true.
Throughput is samples per second over the epochs after the first (which starts the replicas and
compiles), in the plot per epoch too; a speedup above N is printed as suspect, with its likely
cause, and one below 1 with why (``dp_core.slow_speedup``: more replicas, or a mesh's devices,
than cores; a host busy before the runs; steps too small to split).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

GLOBAL_BATCH_SIZE = 64
MIN_ACCURACY = 0.95
# fp32 sums taken in another order differ in the last bits. The demo's model is smooth (swish,
# average pooling), so those bits stay small; see docs/exactness.md for ReLU and max-pooling.
MAX_DIFFERENCE = 1e-4
# --mesh: each conv's output filters and the Dense layer's input rows split over "model".
MESH_LAYOUT = {
    "conv2d.*kernel": (None, None, None, "model"),
    "conv2d.*bias": ("model",),
    "dense.*kernel": ("model", None),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("torch", "jax"), default="torch")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--mesh", help="jax only: RxC, a 2-D ('batch', 'model') mesh of R replicas of C devices")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--output", type=Path, default=Path("demo-output"))
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    mesh_shape = mesh_of(args)
    if mesh_shape is not None:
        args.replicas = mesh_shape[0]
    os.environ["KERAS_BACKEND"] = args.backend
    if args.backend == "jax":  # CPU devices for jax; real accelerators need no flag
        devices = args.replicas if mesh_shape is None else mesh_shape[0] * mesh_shape[1]
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={devices}")
    sys.path.insert(0, str(Path(__file__).parent))
    example = importlib.import_module(f"digits_{args.backend}")
    package = importlib.import_module(f"{args.backend}_dp")
    import dp_core

    data = example.load_data()
    initial_weights = example.build_model().get_weights()
    threads = dp_core.threads_per_replica(args.replicas)
    devices = args.replicas if mesh_shape is None else mesh_shape[0] * mesh_shape[1]
    if crowded := crowding(args, devices):
        print(f"warning: {crowded}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # other work's, before the runs start

    main_name = f"{args.replicas} replicas" if mesh_shape is None else f"a {args.mesh} mesh"
    runs = {}
    for name, replicas in ((main_name, args.replicas), ("1 replica", 1)):
        print(f"\n== {args.backend}_dp: {name}, global batch {GLOBAL_BATCH_SIZE}, {args.epochs} epochs ==")
        if mesh_shape is not None and name == main_name:  # model parallel; the 1-replica run stays plain
            trainer = model_parallel_trainer(package, mesh_shape)
        elif args.backend == "torch":  # the reference on each replica's threads, not every core
            trainer = package.Trainer(num_replicas=replicas, threads_per_replica=threads)
        else:  # one process's XLA thread pool serves every device: the same threads either way
            trainer = package.Trainer(num_replicas=replicas)
        with replica_threads(args.backend, threads):
            result = run(trainer, example, initial_weights, data, args.epochs, "auto" if name == main_name else 2)
        runs[name] = result
    main_run, single = runs[main_name], runs["1 replica"]
    difference = max_difference(main_run["weights"], single["weights"])
    plot = plot_curves(runs, args, main_name, difference)

    print(f"\nheld-out accuracy: {main_run['accuracy']:.4f} on {main_name}, {single['accuracy']:.4f} on 1 replica")
    host = Host(devices=devices, cores=dp_core.available_cores(), load=load, cpu=on_cpu(args.backend))
    for line in throughput_lines(runs, main_name, len(data[0]), args.replicas, host=host, backend=args.backend):
        print(line)
    print(f"exactness: largest weight difference, {main_name} vs 1 replica, after training: {difference:.2e}")
    print(f"curves: {plot}")
    failures = []
    if main_run["accuracy"] < MIN_ACCURACY:
        failures.append(f"accuracy {main_run['accuracy']:.4f} < {MIN_ACCURACY}")
    if difference > MAX_DIFFERENCE:
        failures.append(f"weight difference {difference:.2e} > {MAX_DIFFERENCE}")
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


def mesh_of(args: argparse.Namespace) -> tuple[int, int] | None:
    """``--mesh RxC`` as (R, C); None without it."""
    if args.mesh is None:
        return None
    rows, _, columns = args.mesh.lower().partition("x")
    if args.backend != "jax" or not (rows.isdigit() and columns.isdigit()) or int(rows) < 1 or int(columns) < 1:
        raise SystemExit(f"--mesh takes RxC (e.g. 2x2) with --backend jax; got {args.mesh!r} with {args.backend}")
    return int(rows), int(columns)


class Host(NamedTuple):
    """What the runs shared: the devices of the N-replica run (a mesh's R x C), this process's
    cores, the host's load average before the runs (None where the OS gives none), and whether
    they trained on the CPU."""

    devices: int
    cores: int
    load: float | None
    cpu: bool


def on_cpu(backend: str) -> bool:
    if backend == "torch":
        import torch

        return not torch.cuda.is_available()
    import jax

    return jax.devices()[0].platform == "cpu"


def crowding(args: argparse.Namespace, devices: int) -> str | None:
    """The warning for more replicas, or a mesh's devices, than cores (None when they fit)."""
    import dp_core

    if args.mesh is None:  # jax: one device per replica, the same cores
        return dp_core.oversubscription(args.replicas)
    cores = dp_core.available_cores()
    if devices <= cores:
        return None
    return (
        f"a {args.mesh} mesh is {devices} devices on {cores} core{'s' if cores != 1 else ''}: they take turns on "
        "the CPU, so the speedup over 1 replica says little about more hardware; use a mesh of at most "
        f"{cores} devices on this host."
    )


def model_parallel_trainer(package: Any, mesh_shape: tuple[int, int]) -> Any:
    """jax_dp on a ("batch", "model") mesh, the demo's layers split over "model" by ``MESH_LAYOUT``."""
    import jax

    print(f"model parallel: {mesh_shape[0]} replica(s) of {mesh_shape[1]} device(s) each, layout {MESH_LAYOUT}")
    return package.Trainer(mesh=jax.make_mesh(mesh_shape, ("batch", "model")), layout=MESH_LAYOUT)


@contextlib.contextmanager
def replica_threads(backend: str, threads: int) -> Iterator[None]:
    """This process's torch threads while a run trains: each replica's share of the cores (a
    1-replica run trains here; with N, replica 0 does). jax: unchanged (its XLA pool is per process)."""
    if backend != "torch":
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class EpochTimes:
    """A Keras callback's hooks (added to ``keras.callbacks.Callback`` by ``epoch_timer``): each
    epoch's wall seconds, and the torch threads of the process that trains (None on jax)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []
        self.threads: int | None = None
        self._start = 0.0

    def on_train_begin(self, logs: Any = None) -> None:
        if "torch" in sys.modules:
            self.threads = sys.modules["torch"].get_num_threads()

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def epoch_timer() -> Any:
    import keras

    class EpochTimer(EpochTimes, keras.callbacks.Callback):
        pass

    return EpochTimer()


def run(trainer: Any, example: Any, initial_weights: list, data: tuple, epochs: int, verbose: Any) -> dict[str, Any]:
    x_train, x_test, y_train, y_test = data
    model = example.build_model()
    model.set_weights(initial_weights)
    timer = epoch_timer()
    history = trainer.fit(
        model, x_train, y_train, global_batch_size=GLOBAL_BATCH_SIZE, epochs=epochs,
        validation_data=(x_test, y_test), seed=0, verbose=verbose, callbacks=[timer],
    )  # fmt: skip
    results = trainer.evaluate(model, x_test, y_test, global_batch_size=GLOBAL_BATCH_SIZE, return_dict=True, verbose=0)
    return {
        "history": history.history, "weights": model.get_weights(), "epoch_seconds": timer.seconds,
        "samples_per_second": [len(x_train) / seconds for seconds in timer.seconds], "threads": timer.threads,
        **results,
    }  # fmt: skip


def throughput_lines(
    runs: dict[str, dict[str, Any]], main_name: str, samples: int, replicas: int, *, host: Host, backend: str
) -> list[str]:
    """Both runs' samples/s (median epoch after the first, which starts replicas and compiles), the
    speedup, why it cannot be true when it is above ``replicas``, and why it is below 1 when it is."""
    import dp_core

    def rate(result: dict[str, Any]) -> float:
        timed = result["epoch_seconds"][1:] or result["epoch_seconds"]
        return samples / statistics.median(timed)

    main_rate, single_rate = rate(runs[main_name]), rate(runs["1 replica"])
    speedup = main_rate / single_rate
    threads = {name: result["threads"] for name, result in runs.items()}
    each = "" if threads[main_name] is None else f", {threads[main_name]} thread(s) each"
    lines = [
        f"throughput: {main_rate:,.0f} samples/s on {main_name}{each}; {single_rate:,.0f} samples/s on 1 replica"
        + ("" if threads["1 replica"] is None else f", {threads['1 replica']} thread(s)")
        + " (median epoch after the first)",
        f"speedup: {speedup:.2f}x on {main_name} over 1 replica",
    ]
    suspect = dp_core.suspect_speedup(
        speedup, replicas, threads=threads[main_name], reference_threads=threads["1 replica"], cores=host.cores
    )
    if suspect:
        lines.append(f"SUSPECT: {suspect}")
    # on accelerators the host's cores and load are not what the replicas share
    shared = {"devices": host.devices, "cores": host.cores, "load": host.load} if host.cpu else {"cores": replicas}
    if slow := dp_core.slow_speedup(speedup, replicas, **shared):
        lines.append(f"why: {slow}")
        if backend == "jax" and host.cpu:
            lines.append(
                "why: jax's CPU devices are one process's, sharing its threads: 1 device already computes on "
                "the cores that N devices split between them"
            )
    return lines


def max_difference(left: list, right: list) -> float:
    import numpy as np

    return max(float(np.max(np.abs(a - b))) for a, b in zip(left, right, strict=True))


def curves_figure(runs: dict, args: argparse.Namespace, main_name: str, difference: float) -> Any:
    """Both runs' loss and accuracy per epoch (whole epochs on the axis), saying that the
    1-replica lines lie under the N-replica ones because the runs are equal, and each run's
    samples/s per epoch (the first starts replicas and compiles)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for run_number, (name, result) in enumerate(runs.items()):
        style = "-" if name == main_name else "--"
        for axis, metric in zip(axes[:2], ("loss", "accuracy"), strict=True):
            epochs = range(1, len(result["history"][metric]) + 1)
            # one colour per curve, one line style per run: equal runs draw dashed over solid
            axis.plot(epochs, result["history"][metric], style, color="C0", label=f"train, {name}")
            axis.plot(epochs, result["history"][f"val_{metric}"], style, color="C1", label=f"held-out, {name}")
            axis.set(xlabel="epoch", ylabel=metric, title=metric)
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))
            axis.legend()
        rates = result["samples_per_second"]  # the runs differ here: a colour each
        median = statistics.median(rates[1:] or rates)
        label = f"{name}: {median:,.0f} (median after epoch 1)"
        axes[2].plot(range(1, len(rates) + 1), rates, style, marker="o", color=f"C{2 + run_number}", label=label)
    axes[2].set(xlabel="epoch", ylabel="samples/s", title="throughput", ylim=(0, None))
    axes[2].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[2].legend()
    fig.suptitle(f"{args.backend}_dp on scikit-learn digits: {main_name} vs 1 replica, same data order")
    fig.text(
        0.5, 0.01,
        f"Loss and accuracy: each dashed line (1 replica) lies on the solid line of its colour ({main_name}): "
        f"the runs are equal (largest weight difference after training {difference:.1e}). "
        "Throughput: each epoch's samples/s (the first starts the replicas and compiles).",
        ha="center", fontsize=9,
    )  # fmt: skip
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def plot_curves(runs: dict, args: argparse.Namespace, main_name: str, difference: float) -> Path:
    fig = curves_figure(runs, args, main_name, difference)
    args.output.mkdir(parents=True, exist_ok=True)
    suffix = f"{args.replicas}_replicas" if args.mesh is None else f"mesh_{args.mesh}"
    path = args.output / f"digits_{args.backend}_{suffix}.png"
    fig.savefig(path, dpi=100)
    return path


if __name__ == "__main__":
    sys.exit(main())
