"""keras-dp's main job, end to end: data-parallel training on real data, checked for exactness.

    python examples/demo.py [--backend torch|jax] [--replicas N] [--epochs E] [--output DIR]

Trains the digits convnet of ``digits_<backend>.py`` on N replicas and on 1 replica from
the same initial weights and data order, then prints the held-out accuracy, the
throughput, the largest weight difference between the two runs, and writes a PNG of
both runs' curves.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

GLOBAL_BATCH_SIZE = 64
MIN_ACCURACY = 0.95


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("torch", "jax"), default="torch")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--output", type=Path, default=Path("demo-output"))
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    os.environ["KERAS_BACKEND"] = args.backend
    if args.backend == "jax":  # CPU devices for jax; real accelerators need no flag
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.replicas}")
    sys.path.insert(0, str(Path(__file__).parent))
    example = importlib.import_module(f"digits_{args.backend}")
    package = importlib.import_module(f"{args.backend}_dp")

    x_train, x_test, y_train, y_test = example.load_data()
    initial_weights = example.build_model().get_weights()
    runs = {}
    for replicas in (args.replicas, 1):
        print(f"\n== {args.backend}_dp: {replicas} replica(s), global batch {GLOBAL_BATCH_SIZE} ==")
        trainer = package.Trainer(num_replicas=replicas)
        model = example.build_model()
        model.set_weights(initial_weights)
        start = time.perf_counter()
        history = trainer.fit(
            model, x_train, y_train, global_batch_size=GLOBAL_BATCH_SIZE, epochs=args.epochs,
            validation_data=(x_test, y_test), seed=0, verbose=2 if replicas == 1 else "auto",
        )  # fmt: skip
        seconds = time.perf_counter() - start
        results = trainer.evaluate(model, x_test, y_test, global_batch_size=GLOBAL_BATCH_SIZE, return_dict=True)
        runs[replicas] = {"history": history.history, "weights": model.get_weights(), "seconds": seconds, **results}

    import numpy as np

    main_run, single = runs[args.replicas], runs[1]
    pairs = zip(main_run["weights"], single["weights"], strict=True)
    max_difference = max(float(np.max(np.abs(a - b))) for a, b in pairs)
    samples_per_second = args.epochs * len(x_train) / main_run["seconds"]
    plot = plot_curves(runs, args)
    print(f"\nheld-out accuracy ({args.replicas} replicas): {main_run['accuracy']:.4f}")
    print(f"throughput: {samples_per_second:,.0f} samples/s over the whole fit call, start-up included")
    print(f"exactness: largest weight difference vs 1 replica = {max_difference:.2e}")
    print(f"curves: {plot}")
    if main_run["accuracy"] < MIN_ACCURACY:
        print(f"FAILED: accuracy {main_run['accuracy']:.4f} < {MIN_ACCURACY}")
        return 1
    return 0


def plot_curves(runs: dict, args: argparse.Namespace) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for replicas, run in sorted(runs.items()):
        for axis, metric in zip(axes, ("loss", "accuracy"), strict=True):
            epochs = range(1, len(run["history"][metric]) + 1)
            style = "-" if replicas > 1 else "--"
            axis.plot(epochs, run["history"][metric], style, label=f"train, {replicas} replica(s)")
            axis.plot(epochs, run["history"][f"val_{metric}"], style, label=f"held-out, {replicas} replica(s)")
            axis.set(xlabel="epoch", ylabel=metric, title=metric)
            axis.legend()
    fig.suptitle(f"{args.backend}_dp on scikit-learn digits: {args.replicas} replicas vs 1 (same data order)")
    fig.tight_layout()
    args.output.mkdir(parents=True, exist_ok=True)
    path = args.output / f"digits_{args.backend}_{args.replicas}_replicas.png"
    fig.savefig(path, dpi=100)
    return path


if __name__ == "__main__":
    sys.exit(main())
