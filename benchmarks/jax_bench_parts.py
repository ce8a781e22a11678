"""Pieces of bench_jax.py: an epoch timer, and the runs that need a fresh process because
jax fixes its device count and threads at start-up.

bench_jax.py runs this file as a subprocess, with ``XLA_FLAGS`` and ``BENCH_CPU_CORES`` set,
and reads the JSON it prints on its last line:

    python benchmarks/jax_bench_parts.py scaling --devices 2 --samples-per-device 1024 --epochs 3
    python benchmarks/jax_bench_parts.py memory --devices 2 --rows 65536
    python benchmarks/jax_bench_parts.py no_communication --devices 2 --steps 200
"""

from __future__ import annotations

import os

# Before jax starts its thread pools: the cores this process may run on.
if os.environ.get("BENCH_CPU_CORES") and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {int(core) for core in os.environ["BENCH_CPU_CORES"].split(",")})
os.environ.setdefault("KERAS_BACKEND", "jax")

import argparse
import gc
import json
import resource
import statistics
import time
from typing import Any

import keras
from guide_convnet import compiled_convnet, linear_classifier, synthetic_mnist, wide_rows

PER_REPLICA_BATCH_SIZE = 64  # the convnet runs' 128 over 2 replicas
MEMORY_BATCH_SIZE = 2048


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


class FirstStepClock(keras.callbacks.Callback):
    """``time.perf_counter()`` when the first step has been compiled and dispatched: the
    second step's begin (or the first epoch's end, for one-step epochs). A batch-begin hook
    only: jax_dp brings logs to the host per step only for batch-end hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.first_step_at: float | None = None

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if batch >= 1 and self.first_step_at is None:
            self.first_step_at = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.perf_counter()


def scaling(devices: int, samples_per_device: int, epochs: int) -> dict[str, float]:
    """jax_dp samples/s on ``devices`` devices at 64 rows and ``samples_per_device`` samples each."""
    import jax_dp

    x, y = synthetic_mnist(samples_per_device * devices, one_hot=True)
    timer = EpochTimer()
    jax_dp.Trainer(devices).fit(
        compiled_convnet(one_hot=True),
        x,
        y,
        global_batch_size=PER_REPLICA_BATCH_SIZE * devices,
        epochs=epochs,
        callbacks=[timer],
        verbose=0,
    )
    return {"samples_per_s": len(x) / statistics.median(timer.seconds[1:])}


def no_communication(devices: int, steps: int) -> dict[str, float]:
    """Samples/s of the convnet's train step with no communication at all: each of this process's
    devices trains a copy of its own on a batch of its own (``shard_map``, no all-reduce), in one
    jitted program, the batch placed once. On 2 devices of one process against 2 lone 1-device
    processes, it shows what XLA's CPU runtime itself leaves of the machine's ceiling, before any
    data-parallel work."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    model = compiled_convnet(one_hot=True)
    model.build((None, 28, 28, 1))
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.CategoricalCrossentropy()

    def compute_loss(trainable: Any, non_trainable: Any, x: Any, y: Any) -> Any:
        y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return loss_fn(y, y_pred), non_trainable

    def own_step(state: Any, x: Any, y: Any) -> Any:
        trainable, non_trainable, optimizer_variables = state
        (_, non_trainable), grads = jax.value_and_grad(compute_loss, has_aux=True)(trainable, non_trainable, x, y)
        trainable, optimizer_variables = optimizer.stateless_apply(optimizer_variables, grads, trainable)
        return trainable, non_trainable, optimizer_variables

    mesh = Mesh(jax.devices()[:devices], ("batch",))
    rows = P("batch")
    step = jax.jit(
        jax.shard_map(own_step, mesh=mesh, in_specs=(P(), rows, rows), out_specs=P(), check_vma=False),
        donate_argnums=0,
    )
    state = jax.device_put(
        tuple(
            [v.value for v in variables]
            for variables in (model.trainable_variables, model.non_trainable_variables, optimizer.variables)
        ),
        NamedSharding(mesh, P()),
    )
    x, y = synthetic_mnist(PER_REPLICA_BATCH_SIZE * devices, one_hot=True)
    x, y = (jax.device_put(np.asarray(a), NamedSharding(mesh, rows)) for a in (x, y))
    state = jax.block_until_ready(step(state, x, y))  # compiles
    start = time.perf_counter()
    for _ in range(steps):
        state = step(state, x, y)
    jax.block_until_ready(state)
    return {"samples_per_s": steps * PER_REPLICA_BATCH_SIZE * devices / (time.perf_counter() - start)}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory(devices: int, rows: int) -> dict[str, float]:
    """Peak RSS growth of this process while jax_dp trains one epoch on ``rows`` wide rows.

    The baseline is the RSS after a warm-up fit on one batch's worth of rows (jax, Keras and
    a compiled step in memory); the peak is the process's high-water mark.
    """
    import jax_dp

    x, y = wide_rows(MEMORY_BATCH_SIZE)
    jax_dp.Trainer(devices).fit(linear_classifier(), x, y, global_batch_size=MEMORY_BATCH_SIZE, verbose=0)
    del x, y
    gc.collect()
    baseline = _rss_bytes()
    x, y = wide_rows(rows)
    jax_dp.Trainer(devices).fit(linear_classifier(), x, y, global_batch_size=MEMORY_BATCH_SIZE, verbose=0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    mib = 2**20
    dataset = x.nbytes + y.nbytes
    return {
        "devices": devices,
        "global_batch_size": MEMORY_BATCH_SIZE,
        "dataset_mib": dataset / mib,
        "baseline_rss_mib": baseline / mib,
        "peak_rss_mib": peak / mib,
        "peak_rss_growth_as_fraction_of_dataset": (peak - baseline) / dataset,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", choices=["scaling", "memory", "no_communication"])
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--samples-per-device", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    if args.run == "scaling":
        result = scaling(args.devices, args.samples_per_device, args.epochs)
    elif args.run == "no_communication":
        result = no_communication(args.devices, args.steps)
    else:
        result = memory(args.devices, args.rows)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
