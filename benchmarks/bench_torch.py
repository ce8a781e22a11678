"""torch-dp throughput, start-up time and memory on CPU, against what a Keras user has today.

Same model (the Keras guides' MNIST convnet) and synthetic data of MNIST's shape:

- ``torch_dp``: ``torch_dp.Trainer(num_replicas=2, threads_per_replica=1).fit`` (Keras
  optimizer, loss, metrics, callbacks),
- ``ddp_loop``: the Keras guide's hand-written DDP loop, 2 processes x 1 thread (torch
  optimizer and loss, no metrics),
- ``ddp_loop_keras_work``: the same loop doing torch_dp's per-step work (a training-mode
  forward pass, which the guide's ``model(inputs)`` is not: its Dropout is off; the compiled
  model's Keras loss, Keras optimizer, loss tracker and accuracy metric): it separates the
  cost of that work from the cost of how torch_dp distributes it,
- ``keras_fit``: single-process ``model.fit`` using every core,
- ``torch_dp_1_replica``: ``torch_dp.Trainer(num_replicas=1)`` (in the calling process, held
  to 1 thread) on half the samples at half the global batch: the 1-replica point of the
  weak-scaling efficiency ``throughput(2 replicas) / (2 * throughput(1 replica))``, same
  per-replica batch (64) and per-replica sample count,
- ``lone_pair``: two spawned single-thread ``torch_dp.Trainer(num_replicas=1)`` processes at
  once, each on half the samples, that share nothing: the machine's ceiling for 2 replicas.

Runs are interleaved, the order reversed every other round; throughput is measured after
the first epoch (warm-up) from epoch timestamps; each ratio reported is the median over
rounds of the per-round ratios. Also:
time from the call to the first step, and peak RSS/PSS per worker and over all processes
(caller + workers) training on a 1 GiB array dataset.

    python benchmarks/bench_torch.py [--quick] --output docs/benchmarks/torch.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import torch
import torch.multiprocessing as mp
from guide_convnet import compiled_convnet, linear_classifier, synthetic_mnist, wide_rows
from machine import environment, round_order, usable_cores
from torch_bench_parts import EpochClock, ddp_worker, free_port, lone_fit_worker, watch_memory

import torch_dp

GLOBAL_BATCH_SIZE = 128
MEMORY_ROWS = 65536  # x 4096 float32 columns: a 1 GiB array
MEMORY_BATCH_SIZE = 2048
DDP_LOOP_TIMEOUT_S = 180


def _steady_throughput(times: dict[str, list[float]], num_samples: int) -> float:
    """Samples per second over every epoch after the first."""
    begin, end = times["epoch_begin"][1:], times["epoch_end"][1:]
    return num_samples * len(end) / sum(e - b for b, e in zip(begin, end, strict=True))


def run_torch_dp(num_samples: int, epochs: int, num_replicas: int = 2) -> dict[str, float]:
    """``num_replicas`` x 1 thread at 64 rows per replica; 1 replica runs in this process."""
    x, y = synthetic_mnist(num_samples)
    global_batch_size = GLOBAL_BATCH_SIZE // 2 * num_replicas
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "times.json")
        model = compiled_convnet()
        if num_replicas == 1:
            torch.set_num_threads(1)  # what threads_per_replica=1 does in a spawned worker
        try:
            called = time.time()
            trainer = torch_dp.Trainer(num_replicas=num_replicas, threads_per_replica=1)
            trainer.fit(
                model, x, y, global_batch_size=global_batch_size, epochs=epochs, callbacks=[EpochClock(path)], verbose=0
            )
        finally:
            torch.set_num_threads(threads)
        with open(path) as f:
            times = json.load(f)
    return {"samples_per_s": _steady_throughput(times, num_samples), "first_step_s": times["train_begin"][0] - called}


def run_ddp_loop(num_samples: int, epochs: int, keras_work: bool = False) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "times.json")
        called = time.time()  # each attempt below sets it again
        with environment(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo"):
            for attempt in range(2):  # a rare start-up hang is retried once, not waited on forever
                args, called = (free_port(), num_samples, GLOBAL_BATCH_SIZE, epochs, path, keras_work), time.time()
                context = mp.start_processes(ddp_worker, args=args, nprocs=2, start_method="spawn", join=False)
                deadline = time.time() + DDP_LOOP_TIMEOUT_S
                while not context.join(timeout=1) and time.time() < deadline and not os.path.exists(path):
                    pass
                # rank 0 writes the times once both finished training; a worker can then hang in its
                # exit (torch's spawn wrapper, a gloo thread): the measurement is complete, so it goes
                _ended(context.processes, grace_s=10 if os.path.exists(path) else 0)
                if os.path.exists(path):
                    break
                print(f"ddp_loop: no result after {DDP_LOOP_TIMEOUT_S} s (attempt {attempt + 1})", flush=True)
            else:
                raise TimeoutError(f"the hand-written DDP loop hung twice ({DDP_LOOP_TIMEOUT_S} s each)")
        with open(path) as f:
            times = json.load(f)
    return {"samples_per_s": _steady_throughput(times, num_samples), "first_step_s": times["train_begin"][0] - called}


def _ended(processes: list[Any], *, grace_s: float) -> None:
    """Every process has exited: within ``grace_s``, or killed."""
    deadline = time.time() + grace_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.time()))
        if process.is_alive():
            process.kill()
            process.join(timeout=10)


def run_lone_pair(num_samples: int, epochs: int) -> dict[str, float]:
    """Two spawned single-thread ``torch_dp.Trainer(num_replicas=1)`` processes at once,
    ``num_samples`` each, at the per-replica batch: the machine's own ceiling for 2 replicas,
    with no communication."""
    with tempfile.TemporaryDirectory() as directory:
        with environment(OMP_NUM_THREADS="1"):
            args = (num_samples, GLOBAL_BATCH_SIZE // 2, epochs, directory)
            mp.start_processes(lone_fit_worker, args=args, nprocs=2, start_method="spawn")
        throughputs = []
        for rank in range(2):
            with open(os.path.join(directory, f"times_{rank}.json")) as f:
                throughputs.append(_steady_throughput(json.load(f), num_samples))
    return {"samples_per_s": sum(throughputs)}


def run_keras_fit(num_samples: int, epochs: int) -> dict[str, float]:
    x, y = synthetic_mnist(num_samples)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "times.json")
        model = compiled_convnet()
        called = time.time()
        model.fit(x, y, batch_size=GLOBAL_BATCH_SIZE, epochs=epochs, callbacks=[EpochClock(path)], verbose=0)
        with open(path) as f:
            times = json.load(f)
    return {"samples_per_s": _steady_throughput(times, num_samples), "first_step_s": times["train_begin"][0] - called}


def _peak_memory(num_rows: int) -> dict[str, float]:
    """Peak memory (MiB) while 2 torch_dp workers train one epoch on ``num_rows`` wide rows:
    RSS and PSS of each worker, and the PSS of the caller and of all processes together."""
    x, y = wide_rows(num_rows)
    stop, peaks = threading.Event(), {}
    watcher = threading.Thread(target=watch_memory, args=(stop, peaks), daemon=True)
    watcher.start()
    try:
        torch_dp.Trainer(num_replicas=2, threads_per_replica=1).fit(
            linear_classifier(), x, y, global_batch_size=min(MEMORY_BATCH_SIZE, num_rows), epochs=1, verbose=0
        )
    finally:
        stop.set()
        watcher.join()
    children = [peak for pid, peak in peaks["processes"].items() if pid != "parent"]
    workers = sorted(children, key=lambda p: -p["rss"])[:2]  # not the multiprocessing helpers
    mib = 2**20
    return {
        "dataset_mib": (x.nbytes + y.nbytes) / mib,
        "peak_rss_per_worker_mib": [p["rss"] / mib for p in workers],
        "peak_pss_per_worker_mib": [p["pss"] / mib for p in workers],
        "peak_parent_pss_mib": peaks["processes"]["parent"]["pss"] / mib,
        "peak_total_pss_mib": peaks["total"]["pss"] / mib,
    }


def worker_memory(num_rows: int) -> dict[str, object]:
    """How many copies of a large array dataset the processes hold, from the growth of their
    peak PSS between a tiny dataset and ``num_rows`` rows: per worker, over the workers, and
    over every process (the caller's own array included)."""
    small, large = _peak_memory(MEMORY_BATCH_SIZE), _peak_memory(num_rows)  # same batches, no data to speak of
    extra = large["dataset_mib"] - small["dataset_mib"]
    baseline = statistics.mean(small["peak_pss_per_worker_mib"])  # a worker with next to no data
    per_worker = [(pss - baseline) / extra for pss in large["peak_pss_per_worker_mib"]]
    rss_baseline = statistics.mean(small["peak_rss_per_worker_mib"])
    rss_per_worker = [(rss - rss_baseline) / extra for rss in large["peak_rss_per_worker_mib"]]
    return {
        "num_workers": 2,
        "global_batch_size": MEMORY_BATCH_SIZE,
        "small": small,
        "large": large,
        "pss_growth_per_worker_as_fraction_of_dataset": max(per_worker),
        "rss_growth_per_worker_as_fraction_of_dataset": max(rss_per_worker),
        "pss_growth_of_workers_as_fraction_of_dataset": sum(per_worker),
        "pss_growth_of_parent_as_fraction_of_dataset": (large["peak_parent_pss_mib"] - small["peak_parent_pss_mib"])
        / extra,
        "pss_growth_in_total_as_fraction_of_dataset": (large["peak_total_pss_mib"] - small["peak_total_pss_mib"])
        / extra,
    }


def _per_round(runs: dict[str, list[dict[str, float]]], mine: str, theirs: str, scale: float = 1.0) -> list[float]:
    """The ratio ``mine / (scale * theirs)`` of samples/s in each round."""
    pairs = zip(runs[mine], runs[theirs], strict=True)
    return [a["samples_per_s"] / (scale * b["samples_per_s"]) for a, b in pairs]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short round (a smoke run, not a measurement)")
    parser.add_argument("--output", default=None, help="where to write the JSON results")
    args = parser.parse_args(argv)
    rounds, num_samples, epochs, memory_rows = (1, 1024, 2, 16384) if args.quick else (6, 1536, 2, MEMORY_ROWS)
    contenders = {
        "torch_dp": lambda: run_torch_dp(num_samples, epochs),
        "ddp_loop": lambda: run_ddp_loop(num_samples, epochs),
        "ddp_loop_keras_work": lambda: run_ddp_loop(num_samples, epochs, keras_work=True),
        "keras_fit": lambda: run_keras_fit(num_samples, epochs),
        "torch_dp_1_replica": lambda: run_torch_dp(num_samples // 2, epochs, num_replicas=1),
        "lone_pair": lambda: run_lone_pair(num_samples // 2, epochs),
    }
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
    cores: list[float] = []
    for round_index in range(rounds):
        cores.append(usable_cores())  # other jobs on the machine show here
        for name, run in round_order(contenders, round_index):
            runs[name].append(run())
            print(f"round {round_index} {name}: {runs[name][-1]}", flush=True)
    efficiency = _per_round(runs, "torch_dp", "torch_dp_1_replica", scale=2)
    one_replica = statistics.median(r["samples_per_s"] for r in runs["torch_dp_1_replica"])
    of_ceiling = _per_round(runs, "torch_dp", "lone_pair")
    lone_pair = statistics.median(r["samples_per_s"] for r in runs["lone_pair"])
    results = {
        "setup": {
            "model": "Keras guides' MNIST convnet",
            "global_batch_size": GLOBAL_BATCH_SIZE,
            "num_samples": num_samples,
            "epochs": epochs,
            "rounds": rounds,
            "replicas": "2 processes x 1 thread (keras_fit: 1 process, all cores)",
            "cores": os.cpu_count(),
            "quick": args.quick,
        },
        "versions": {"torch": torch.__version__, "keras": keras.__version__, "torch_dp": torch_dp.__version__},
        "host": {"machine": platform.machine(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "usable_cores": cores,
        "runs": runs,
        "median_ratio_vs_ddp_loop": statistics.median(_per_round(runs, "torch_dp", "ddp_loop")),
        "median_ratio_vs_ddp_loop_keras_work": statistics.median(_per_round(runs, "torch_dp", "ddp_loop_keras_work")),
        "median_ratio_of_keras_work_in_ddp_loop": statistics.median(
            _per_round(runs, "ddp_loop_keras_work", "ddp_loop")
        ),
        "median_ratio_vs_keras_fit": statistics.median(_per_round(runs, "torch_dp", "keras_fit")),
        "median_first_step_s": {
            name: statistics.median(r["first_step_s"] for r in rs) for name, rs in runs.items() if name != "lone_pair"
        },
        "weak_scaling": {
            "per_replica_batch_size": GLOBAL_BATCH_SIZE // 2,
            "samples_per_replica": num_samples // 2,
            "threads_per_replica": 1,
            "median_samples_per_s": {
                str(replicas): statistics.median(r["samples_per_s"] for r in runs[name])
                for replicas, name in ((1, "torch_dp_1_replica"), (2, "torch_dp"))
            },
            "efficiency_per_round": efficiency,
            "median_efficiency": statistics.median(efficiency),
            "lone_pair_samples_per_s": lone_pair,
            "lone_pair_efficiency": lone_pair / (2 * one_replica),
            "of_ceiling_per_round": of_ceiling,
            "median_of_ceiling": statistics.median(of_ceiling),
        },
        "memory": worker_memory(memory_rows),
    }
    print(f"torch_dp / hand-written DDP loop: {results['median_ratio_vs_ddp_loop']:.3f}x (target >= 0.95x)")
    print(f"torch_dp / the DDP loop doing Keras's work: {results['median_ratio_vs_ddp_loop_keras_work']:.3f}x")
    print(f"torch_dp / single-process model.fit: {results['median_ratio_vs_keras_fit']:.3f}x")
    print(f"weak-scaling efficiency 1 -> 2 replicas: {results['weak_scaling']['median_efficiency']:.3f}")
    print(f"of the machine's ceiling (two lone processes): {results['weak_scaling']['median_of_ceiling']:.3f}")
    print(f"time to first step (s): {results['median_first_step_s']}")
    print(f"memory: {results['memory']}")
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
