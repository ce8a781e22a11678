"""jax-dp ``fit`` throughput against what a jax user would otherwise write.

The Keras guides' MNIST convnet on synthetic (N, 28, 28, 1) data, data-parallel over
2 host CPU devices, three ways:

- ``jax_dp``: ``jax_dp.Trainer(2).fit(model, x, y, global_batch_size=128)``, the model
  compiled as in the guide (loss and accuracy);
- ``jax_dp_loss_only``: the same without the accuracy metric, i.e. the work the guide's
  loop does (it computes no metric), to separate the trainer's cost from the metric's;
- ``guide_loop``: the hand-written loop of the Keras guide "Multi-GPU distributed
  training with JAX" (``stateless_call`` + ``stateless_apply`` jitted, replicated
  state, ``device_put`` of each batch with a ``"batch"`` sharding);
- ``keras_data_parallel``: ``keras.distribution.DataParallel`` + ``model.fit``.

Runs are interleaved (one of each per round) and each round's first epoch, which
compiles, is not timed. Reported: samples/s per run, their medians, and the median
over rounds of the per-round ratios jax_dp / other.

    python benchmarks/bench_jax.py [--quick] --output docs/benchmarks/jax.json
"""

from __future__ import annotations

import os

# Before jax is imported: two CPU devices and the jax backend for Keras.
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import keras
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_dp

NUM_DEVICES = 2
GLOBAL_BATCH = 128  # the guide's batch_size
NUM_CLASSES = 10


def convnet(metrics: tuple[str, ...] = ("accuracy",)) -> keras.Model:
    """keras.io/examples/vision/mnist_convnet, compiled as in the guide."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input(shape=(28, 28, 1)),
            keras.layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
            keras.layers.MaxPooling2D(pool_size=(2, 2)),
            keras.layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
            keras.layers.MaxPooling2D(pool_size=(2, 2)),
            keras.layers.Flatten(),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(NUM_CLASSES, activation="softmax"),
        ]
    )
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=list(metrics))
    return model


def synthetic_mnist(num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.random((num_samples, 28, 28, 1), dtype=np.float32)
    y = np.eye(NUM_CLASSES, dtype=np.float32)[rng.integers(0, NUM_CLASSES, num_samples)]
    return x, y


class EpochTimer(keras.callbacks.Callback):
    """Wall time of each epoch; on_epoch_end comes after the epoch's logs reached the host."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []
        self._start = 0.0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def run_jax_dp(x: np.ndarray, y: np.ndarray, epochs: int, metrics: tuple[str, ...] = ("accuracy",)) -> list[float]:
    model, timer = convnet(metrics), EpochTimer()
    jax_dp.Trainer(NUM_DEVICES).fit(
        model, x, y, global_batch_size=GLOBAL_BATCH, epochs=epochs, callbacks=[timer], verbose=0
    )
    return timer.seconds


def run_keras_data_parallel(x: np.ndarray, y: np.ndarray, epochs: int) -> list[float]:
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()[:NUM_DEVICES]))
    try:
        model, timer = convnet(), EpochTimer()
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, callbacks=[timer], verbose=0)
    finally:
        keras.distribution.set_distribution(None)
    return timer.seconds


def run_guide_loop(x: np.ndarray, y: np.ndarray, epochs: int) -> list[float]:
    """The guide's loop, nearly verbatim: jit(train_step), replicated state, sharded batches."""
    model = convnet()
    model.build((None, 28, 28, 1))
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.CategoricalCrossentropy()

    def compute_loss(trainable_variables, non_trainable_variables, x, y):
        y_pred, non_trainable_variables = model.stateless_call(
            trainable_variables, non_trainable_variables, x, training=True
        )
        return loss_fn(y, y_pred), non_trainable_variables

    compute_gradients = jax.value_and_grad(compute_loss, has_aux=True)

    @jax.jit
    def train_step(train_state, x, y):
        trainable_variables, non_trainable_variables, optimizer_variables = train_state
        (loss_value, non_trainable_variables), grads = compute_gradients(
            trainable_variables, non_trainable_variables, x, y
        )
        trainable_variables, optimizer_variables = optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables
        )
        return loss_value, (trainable_variables, non_trainable_variables, optimizer_variables)

    devices = jax.devices()[:NUM_DEVICES]
    replicated = NamedSharding(Mesh(devices, axis_names=("_",)), P())
    data_sharding = NamedSharding(Mesh(devices, axis_names=("batch",)), P("batch"))
    train_state = jax.device_put(
        (
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in optimizer.variables],
        ),
        replicated,
    )
    seconds = []
    for _ in range(epochs):
        start = time.perf_counter()
        loss_value = None
        for begin in range(0, len(x), GLOBAL_BATCH):
            batch_x = jax.device_put(x[begin : begin + GLOBAL_BATCH], data_sharding)
            batch_y = jax.device_put(y[begin : begin + GLOBAL_BATCH], data_sharding)
            loss_value, train_state = train_step(train_state, batch_x, batch_y)
        float(loss_value)  # the guide prints the loss once per epoch
        seconds.append(time.perf_counter() - start)
    return seconds


CONTENDERS: dict[str, Callable[[np.ndarray, np.ndarray, int], list[float]]] = {
    "jax_dp": run_jax_dp,
    "jax_dp_loss_only": lambda x, y, epochs: run_jax_dp(x, y, epochs, metrics=()),
    "guide_loop": run_guide_loop,
    "keras_data_parallel": run_keras_data_parallel,
}


def benchmark(num_samples: int, rounds: int, epochs: int) -> dict[str, Any]:
    x, y = synthetic_mnist(num_samples)
    samples_per_second: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for round_index in range(rounds):
        for name, run in CONTENDERS.items():  # interleaved: drift hits every contender alike
            timed = run(x, y, epochs)[1:]  # epoch 0 compiles
            samples_per_second[name].append(num_samples / statistics.median(timed))
            print(f"round {round_index}: {name:>20} {samples_per_second[name][-1]:10.0f} samples/s", flush=True)

    def median_ratio(ours: str, theirs: str) -> float:
        pairs = zip(samples_per_second[ours], samples_per_second[theirs], strict=True)
        return statistics.median(a / b for a, b in pairs)

    ratios = {other: median_ratio("jax_dp", other) for other in ("guide_loop", "keras_data_parallel")}
    return {
        "model": "keras.io mnist_convnet (Conv32-Pool-Conv64-Pool-Flatten-Dropout-Dense10), adam, accuracy",
        "data": f"synthetic float32 ({num_samples}, 28, 28, 1), one-hot labels",
        "devices": f"{NUM_DEVICES} host CPU devices (--xla_force_host_platform_device_count)",
        "global_batch_size": GLOBAL_BATCH,
        "rounds": rounds,
        "epochs_per_run": epochs,
        "timed": "median epoch time of each run, first (compiling) epoch excluded",
        "samples_per_second": samples_per_second,
        "median_samples_per_second": {name: statistics.median(v) for name, v in samples_per_second.items()},
        "median_ratio_jax_dp_over": ratios,
        "median_ratio_jax_dp_loss_only_over_guide_loop": median_ratio("jax_dp_loss_only", "guide_loop"),
        "versions": {"jax": jax.__version__, "keras": keras.__version__, "jax_dp": jax_dp.__version__},
        "host": {"machine": platform.machine(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer samples, rounds and epochs")
    parser.add_argument("--output", default="docs/benchmarks/jax.json", help="where the JSON results go")
    args = parser.parse_args()
    if args.quick:
        results = benchmark(num_samples=GLOBAL_BATCH * 8, rounds=2, epochs=2)
    else:
        results = benchmark(num_samples=GLOBAL_BATCH * 24, rounds=5, epochs=2)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=2)
    for other, ratio in results["median_ratio_jax_dp_over"].items():
        print(f"jax_dp / {other}: {ratio:.2f}x (median over {results['rounds']} interleaved rounds)")
    loss_only = results["median_ratio_jax_dp_loss_only_over_guide_loop"]
    print(f"jax_dp_loss_only / guide_loop: {loss_only:.2f}x (same work as the guide: no accuracy metric)")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
