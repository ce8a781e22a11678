"""keras-dp's main job, end to end: data-parallel training on real data, checked for exactness.

    python examples/demo.py [--backend torch|jax] [--replicas N | --mesh RxC] [--epochs E] [--output DIR]

Trains the digits convnet of ``digits_<backend>.py`` on N replicas and on 1 replica from the
same initial weights and data order. With ``--mesh RxC`` (jax), the first run is model
parallel instead: R replicas, each a row of C devices that split the convolutions' filters and
the Dense layer's kernel between them (``MESH_LAYOUT``). Prints the held-out accuracy, the throughput and the
exactness check (the largest weight difference between the two trained models), and writes
a PNG of both runs' loss and accuracy curves.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

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
    data = example.load_data()
    initial_weights = example.build_model().get_weights()

    main_name = f"{args.replicas} replicas" if mesh_shape is None else f"a {args.mesh} mesh"
    runs = {}
    for name, replicas in ((main_name, args.replicas), ("1 replica", 1)):
        print(f"\n== {args.backend}_dp: {name}, global batch {GLOBAL_BATCH_SIZE}, {args.epochs} epochs ==")
        if mesh_shape is not None and name == main_name:  # model parallel; the 1-replica run stays plain
            trainer = model_parallel_trainer(package, mesh_shape)
        else:
            trainer = package.Trainer(num_replicas=replicas)
        runs[name] = run(trainer, example, initial_weights, data, args.epochs, "auto" if name == main_name else 2)
    main_run, single = runs[main_name], runs["1 replica"]
    difference = max_difference(main_run["weights"], single["weights"])
    samples_per_second = args.epochs * len(data[0]) / main_run["seconds"]
    plot = plot_curves(runs, args, main_name)

    print(f"\nheld-out accuracy: {main_run['accuracy']:.4f} on {main_name}, {single['accuracy']:.4f} on 1 replica")
    print(f"throughput: {samples_per_second:,.0f} samples/s on {main_name}, over the whole fit call")
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


def model_parallel_trainer(package: Any, mesh_shape: tuple[int, int]) -> Any:
    """jax_dp on a ("batch", "model") mesh, the demo's layers split over "model" by ``MESH_LAYOUT``."""
    import jax

    print(f"model parallel: {mesh_shape[0]} replica(s) of {mesh_shape[1]} device(s) each, layout {MESH_LAYOUT}")
    return package.Trainer(mesh=jax.make_mesh(mesh_shape, ("batch", "model")), layout=MESH_LAYOUT)


def run(trainer: Any, example: Any, initial_weights: list, data: tuple, epochs: int, verbose: Any) -> dict[str, Any]:
    x_train, x_test, y_train, y_test = data
    model = example.build_model()
    model.set_weights(initial_weights)
    start = time.perf_counter()
    history = trainer.fit(
        model, x_train, y_train, global_batch_size=GLOBAL_BATCH_SIZE, epochs=epochs,
        validation_data=(x_test, y_test), seed=0, verbose=verbose,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    results = trainer.evaluate(model, x_test, y_test, global_batch_size=GLOBAL_BATCH_SIZE, return_dict=True, verbose=0)
    return {"history": history.history, "weights": model.get_weights(), "seconds": seconds, **results}


def max_difference(left: list, right: list) -> float:
    import numpy as np

    return max(float(np.max(np.abs(a - b))) for a, b in zip(left, right, strict=True))


def plot_curves(runs: dict, args: argparse.Namespace, main_name: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, result in runs.items():
        style = "-" if name == main_name else "--"
        for axis, metric in zip(axes, ("loss", "accuracy"), strict=True):
            epochs = range(1, len(result["history"][metric]) + 1)
            axis.plot(epochs, result["history"][metric], style, label=f"train, {name}")
            axis.plot(epochs, result["history"][f"val_{metric}"], style, label=f"held-out, {name}")
            axis.set(xlabel="epoch", ylabel=metric, title=metric)
            axis.legend()
    fig.suptitle(f"{args.backend}_dp on scikit-learn digits: {main_name} vs 1 replica, same data order")
    fig.tight_layout()
    args.output.mkdir(parents=True, exist_ok=True)
    suffix = f"{args.replicas}_replicas" if args.mesh is None else f"mesh_{args.mesh}"
    path = args.output / f"digits_{args.backend}_{suffix}.png"
    fig.savefig(path, dpi=100)
    return path


if __name__ == "__main__":
    sys.exit(main())
