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

Runs are interleaved (one of each per round, the order reversed every other round) and
each run's first epoch, which compiles, is not timed. Reported: samples/s per run, their
medians, and the median over rounds of the per-round ratios jax_dp / other; jax_dp's time
from the ``fit`` call to its first step (compiled and dispatched).

Then jax_dp against ``keras.distribution`` + ``model.fit`` on the guides' BatchNorm convnet, at
three global batches, without and with a batch callback or the progress bar (``jax_vs_keras.py``).

Then, each in a fresh process (``jax_bench_parts.py``): weak scaling of jax_dp from 1 to
2 devices (64 rows and the same sample count per device, one core and one XLA thread per
device, interleaved rounds) against the machine's ceiling (two lone 1-device processes at
once, each on a core of its own); jax_dp on 2 devices with and without glibc's malloc told to keep
its heap (``KEPT_HEAP``, environment variables set before Python starts); and the peak RSS growth
of one jax_dp process fitting a linear model on a 1 GiB array over 2 devices.

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
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import keras
import numpy as np
from guide_convnet import compiled_convnet, synthetic_mnist
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax_bench_parts import EpochTimer, FirstStepClock
from jax_vs_keras import versus_keras_distribution
from machine import environment, round_order, usable_cores

import jax_dp

NUM_DEVICES = 2
GLOBAL_BATCH = 128  # the guide's batch_size
HERE = Path(__file__).resolve().parent
# Each weak-scaling process: N devices on N cores, XLA's CPU ops single-threaded.
SCALING_XLA_FLAGS = "--xla_force_host_platform_device_count={devices} --xla_cpu_multi_thread_eigen=false"
NO_COMMUNICATION_STEPS = 60  # a few seconds a run


FIRST_STEP_S: list[float] = []  # jax_dp's time from the fit call to its first step, per run


def run_jax_dp(x: np.ndarray, y: np.ndarray, epochs: int, metrics: tuple[str, ...] = ("accuracy",)) -> list[float]:
    model, timer, clock = compiled_convnet(one_hot=True, metrics=metrics), EpochTimer(), FirstStepClock()
    called = time.perf_counter()
    jax_dp.Trainer(NUM_DEVICES).fit(
        model, x, y, global_batch_size=GLOBAL_BATCH, epochs=epochs, callbacks=[timer, clock], verbose=0
    )
    if metrics and clock.first_step_at is not None:
        FIRST_STEP_S.append(clock.first_step_at - called)
    return timer.seconds


def run_keras_data_parallel(x: np.ndarray, y: np.ndarray, epochs: int) -> list[float]:
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()[:NUM_DEVICES]))
    try:
        model, timer = compiled_convnet(one_hot=True), EpochTimer()
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, callbacks=[timer], verbose=0)
    finally:
        keras.distribution.set_distribution(None)
    return timer.seconds


def run_guide_loop(x: np.ndarray, y: np.ndarray, epochs: int) -> list[float]:
    """The guide's loop, nearly verbatim: jit(train_step), replicated state, sharded batches."""
    model = compiled_convnet(one_hot=True)
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


def _in_fresh_process(run: str, devices: int, xla_flags: str, *options: str) -> dict[str, float]:
    """One run of jax_bench_parts.py in a new process on ``devices`` cores; its JSON result."""
    cores = sorted(os.sched_getaffinity(0))[:devices] if hasattr(os, "sched_getaffinity") else []
    env = {
        **os.environ,
        "KERAS_BACKEND": "jax",
        "XLA_FLAGS": xla_flags,
        "BENCH_CPU_CORES": ",".join(map(str, cores)),
    }
    command = [sys.executable, str(HERE / "jax_bench_parts.py"), run, "--devices", str(devices), *options]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _lone_pair(run: str, *options: str) -> float:
    """The machine's ceiling for 2 replicas: two 1-device processes of ``run`` that share nothing,
    each on a core of its own, at once; their samples/s added up."""
    cores = sorted(os.sched_getaffinity(0))[:2] if hasattr(os, "sched_getaffinity") else [0, 1]
    flags = SCALING_XLA_FLAGS.format(devices=1)
    command = [sys.executable, str(HERE / "jax_bench_parts.py"), run, "--devices", "1", *options]
    pair = [
        subprocess.Popen(
            command,
            env={**os.environ, "KERAS_BACKEND": "jax", "XLA_FLAGS": flags, "BENCH_CPU_CORES": str(core)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for core in cores
    ]
    total = 0.0
    for process in pair:
        out, err = process.communicate(timeout=600)
        if process.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}):\n{err[-4000:]}")
        total += json.loads(out.strip().splitlines()[-1])["samples_per_s"]
    return total


def weak_scaling(samples_per_device: int, epochs: int, rounds: int) -> dict[str, Any]:
    """jax_dp on 1 and 2 devices, same per-device batch and sample count, and the machine's ceiling
    (two lone 1-device processes at once), interleaved rounds. Also in each round: the convnet's
    step with no communication at all (``jax_bench_parts.no_communication``) on 2 devices of one
    process against 2 lone processes of it, what XLA's CPU runtime leaves of the ceiling by itself.

    Each run is its own process (jax fixes the device count at start-up), pinned to as many
    cores as it has devices, with XLA's CPU ops single-threaded: 1 thread per device.
    """
    per_devices: dict[int, list[float]] = {1: [], 2: []}
    lone_pair: list[float] = []
    no_communication: dict[str, list[float]] = {"one_process": [], "lone_pair": []}
    cores: list[float] = []
    options = ("--samples-per-device", str(samples_per_device), "--epochs", str(epochs))
    steps = ("--steps", str(NO_COMMUNICATION_STEPS))
    for round_index in range(rounds):
        cores.append(usable_cores())
        for devices, samples_per_s in per_devices.items():
            flags = SCALING_XLA_FLAGS.format(devices=devices)
            samples_per_s.append(_in_fresh_process("scaling", devices, flags, *options)["samples_per_s"])
            print(f"round {round_index}: jax_dp on {devices} device(s) {samples_per_s[-1]:10.0f} samples/s", flush=True)
        lone_pair.append(_lone_pair("scaling", *options))
        print(f"round {round_index}: 2 lone 1-device processes {lone_pair[-1]:10.0f} samples/s", flush=True)
        flags = SCALING_XLA_FLAGS.format(devices=2)
        no_communication["one_process"].append(_in_fresh_process("no_communication", 2, flags, *steps)["samples_per_s"])
        no_communication["lone_pair"].append(_lone_pair("no_communication", *steps))
        print(
            f"round {round_index}: no communication, 1 process / 2 lone {no_communication['one_process'][-1]:.0f}"
            f" / {no_communication['lone_pair'][-1]:.0f} samples/s",
            flush=True,
        )
    efficiency = [two / (2 * one) for one, two in zip(per_devices[1], per_devices[2], strict=True)]
    of_ceiling = [two / pair for two, pair in zip(per_devices[2], lone_pair, strict=True)]
    return {
        "per_replica_batch_size": GLOBAL_BATCH // NUM_DEVICES,
        "samples_per_replica": samples_per_device,
        "epochs_per_run": epochs,
        "xla_flags": SCALING_XLA_FLAGS.format(devices="N"),
        "cpu_affinity": "N cores for N devices (os.sched_setaffinity before jax starts)",
        "usable_cores": cores,
        "samples_per_second": {str(devices): values for devices, values in per_devices.items()},
        "median_samples_per_s": {str(devices): statistics.median(v) for devices, v in per_devices.items()},
        "efficiency_per_round": efficiency,
        "median_efficiency": statistics.median(efficiency),
        "lone_pair_samples_per_s": lone_pair,
        "lone_pair_efficiency": statistics.median(
            pair / (2 * one) for pair, one in zip(lone_pair, per_devices[1], strict=True)
        ),
        "of_ceiling_per_round": of_ceiling,
        "median_of_ceiling": statistics.median(of_ceiling),
        "no_communication": {
            "what": "the convnet's step with no communication: each device trains its own copy on its own batch,"
            " placed once (shard_map, no all-reduce)",
            "samples_per_second": no_communication,
            "median_one_process_of_ceiling": statistics.median(
                one / pair
                for one, pair in zip(no_communication["one_process"], no_communication["lone_pair"], strict=True)
            ),
            "median_jax_dp_of_one_process": statistics.median(
                two / one for two, one in zip(per_devices[2], no_communication["one_process"], strict=True)
            ),
        },
    }


# glibc's malloc settings that keep XLA:CPU's per-step buffers (tens of MB a device) in the heap for
# the next step, instead of mapping them fresh (and page-faulting them in) every step.
KEPT_HEAP = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**30)}


def kept_heap(samples_per_device: int, epochs: int, rounds: int) -> dict[str, Any]:
    """jax_dp on 2 devices in a fresh process, with and without ``KEPT_HEAP`` in its environment
    (set before Python starts), interleaved rounds: what glibc's allocator costs a CPU step."""
    flags = SCALING_XLA_FLAGS.format(devices=2)
    options = ("--samples-per-device", str(samples_per_device), "--epochs", str(epochs))
    runs: dict[str, list[float]] = {"default": [], "kept_heap": []}
    for round_index in range(rounds):
        for name, _ in round_order(runs, round_index):
            with environment(**(KEPT_HEAP if name == "kept_heap" else {})):
                runs[name].append(_in_fresh_process("scaling", 2, flags, *options)["samples_per_s"])
            print(
                f"round {round_index}: jax_dp on 2 devices, malloc {name}: {runs[name][-1]:.0f} samples/s", flush=True
            )
    ratios = [kept / default for kept, default in zip(runs["kept_heap"], runs["default"], strict=True)]
    return {
        "environment": KEPT_HEAP,
        "samples_per_second": runs,
        "ratio_per_round": ratios,
        "median_ratio": statistics.median(ratios),
    }


def peak_memory(rows: int) -> dict[str, float]:
    """jax_dp's peak RSS growth fitting on ``rows`` x 4096 float32 (65,536 rows: 1 GiB), 2 devices."""
    flags = f"--xla_force_host_platform_device_count={NUM_DEVICES}"
    return _in_fresh_process("memory", NUM_DEVICES, flags, "--rows", str(rows))


def benchmark(num_samples: int, rounds: int, epochs: int) -> dict[str, Any]:
    FIRST_STEP_S.clear()
    x, y = synthetic_mnist(num_samples, one_hot=True)
    samples_per_second: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    cores: list[float] = []
    for round_index in range(rounds):
        cores.append(usable_cores())  # other jobs on the machine show here
        for name, run in round_order(CONTENDERS, round_index):
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
        "usable_cores": cores,
        "samples_per_second": samples_per_second,
        "median_samples_per_second": {name: statistics.median(v) for name, v in samples_per_second.items()},
        "median_ratio_jax_dp_over": ratios,
        "median_ratio_jax_dp_loss_only_over_guide_loop": median_ratio("jax_dp_loss_only", "guide_loop"),
        "median_first_step_s": {"jax_dp": statistics.median(FIRST_STEP_S)},
        "versions": {"jax": jax.__version__, "keras": keras.__version__, "jax_dp": jax_dp.__version__},
        "host": {"machine": platform.machine(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer samples, rounds and epochs")
    parser.add_argument("--output", default="docs/benchmarks/jax.json", help="where the JSON results go")
    args = parser.parse_args()
    if args.quick:
        results = benchmark(num_samples=GLOBAL_BATCH * 8, rounds=1, epochs=2)
        results["keras_distribution"] = versus_keras_distribution(num_samples=512, rounds=1, epochs=2, batches=(64,))
        results["weak_scaling"] = weak_scaling(samples_per_device=256, epochs=2, rounds=1)
        results["kept_heap"] = kept_heap(samples_per_device=256, epochs=2, rounds=1)
        results["memory"] = peak_memory(rows=16384)
    else:
        results = benchmark(num_samples=GLOBAL_BATCH * 30, rounds=6, epochs=3)  # 2 timed epochs of 30 steps
        results["keras_distribution"] = versus_keras_distribution(num_samples=3840, rounds=5, epochs=3)
        results["weak_scaling"] = weak_scaling(samples_per_device=1024, epochs=3, rounds=5)
        results["kept_heap"] = kept_heap(samples_per_device=1024, epochs=3, rounds=3)
        results["memory"] = peak_memory(rows=65536)
    results["quick"] = args.quick
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=2)
    for other, ratio in results["median_ratio_jax_dp_over"].items():
        print(f"jax_dp / {other}: {ratio:.2f}x (median over {results['rounds']} interleaved rounds)")
    loss_only = results["median_ratio_jax_dp_loss_only_over_guide_loop"]
    print(f"jax_dp_loss_only / guide_loop: {loss_only:.2f}x (same work as the guide: no accuracy metric)")
    print(f"first step after {results['median_first_step_s']['jax_dp']:.1f} s (median)")
    efficiency = results["weak_scaling"]["median_efficiency"]
    print(f"weak-scaling efficiency 1 -> 2 devices: {efficiency:.3f}")
    of_ceiling = results["weak_scaling"]["median_of_ceiling"]
    print(f"of the machine's ceiling (two lone processes): {of_ceiling:.3f} (goal >= 0.95)")
    print(f"memory: {results['memory']}")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
