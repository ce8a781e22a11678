"""torch-dp throughput, start-up time and memory on CPU, against what a Keras user has today.

Same model (the Keras guides' MNIST convnet) and synthetic data of MNIST's shape:

- ``torch_dp``: ``torch_dp.Trainer(num_replicas=2, threads_per_replica=1).fit`` (Keras
  optimizer, loss, metrics, callbacks),
- ``ddp_loop``: the Keras guide's hand-written DDP loop, 2 processes x 1 thread (torch
  optimizer and loss, no metrics),
- ``keras_fit``: single-process ``model.fit`` using every core.

Runs are interleaved; throughput is measured after the first epoch (warm-up) from epoch
timestamps; the ratio reported is the median over rounds. Also: time from the call to
the first step, and peak RSS/PSS per worker training on a large array dataset.

    python benchmarks/bench_torch.py [--quick] --output docs/benchmarks/torch.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import torch.multiprocessing as mp
from torch_bench_parts import (
    EpochClock,
    compiled_convnet,
    ddp_worker,
    linear_classifier,
    peak_memory_of_children,
    synthetic_mnist,
    wide_rows,
)

import torch_dp
from torch_dp._launch import free_port

GLOBAL_BATCH_SIZE = 128


def _steady_throughput(times: dict[str, list[float]], num_samples: int) -> float:
    """Samples per second over every epoch after the first."""
    begin, end = times["epoch_begin"][1:], times["epoch_end"][1:]
    return num_samples * len(end) / sum(e - b for b, e in zip(begin, end, strict=True))


def run_torch_dp(num_samples: int, epochs: int) -> dict[str, float]:
    x, y = synthetic_mnist(num_samples)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "times.json")
        model = compiled_convnet()
        called = time.time()
        trainer = torch_dp.Trainer(num_replicas=2, threads_per_replica=1)
        trainer.fit(
            model, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=epochs, callbacks=[EpochClock(path)], verbose=0
        )
        with open(path) as f:
            times = json.load(f)
    return {"samples_per_s": _steady_throughput(times, num_samples), "first_step_s": times["train_begin"][0] - called}


def run_ddp_loop(num_samples: int, epochs: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "times.json")
        called = time.time()
        saved = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")}
        os.environ.update({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
        try:
            args = (free_port(), num_samples, GLOBAL_BATCH_SIZE, epochs, path)
            mp.start_processes(ddp_worker, args=args, nprocs=2, start_method="spawn")
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        with open(path) as f:
            times = json.load(f)
    return {"samples_per_s": _steady_throughput(times, num_samples), "first_step_s": times["train_begin"][0] - called}


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


def _peak_worker_memory(num_rows: int) -> dict[str, float]:
    """Peak RSS and PSS (MiB) of the two torch_dp workers training one epoch on ``num_rows`` rows."""
    x, y = wide_rows(num_rows)
    stop, peaks = threading.Event(), {}
    watcher = threading.Thread(target=peak_memory_of_children, args=(stop, peaks), daemon=True)
    watcher.start()
    try:
        torch_dp.Trainer(num_replicas=2, threads_per_replica=1).fit(
            linear_classifier(), x, y, global_batch_size=1024, epochs=1, verbose=0
        )
    finally:
        stop.set()
        watcher.join()
    workers = sorted(peaks.values(), key=lambda p: -p["rss"])[:2]
    mib = 2**20
    return {
        "dataset_mib": (x.nbytes + y.nbytes) / mib,
        "peak_rss_mib": max(p["rss"] for p in workers) / mib,
        "peak_pss_mib": max(p["pss"] for p in workers) / mib,
    }


def worker_memory(num_rows: int) -> dict[str, object]:
    """How much of a large array dataset each worker holds: PSS grows by half the dataset per
    worker when the two share one memory-mapped copy, by all of it when each has its own."""
    small, large = _peak_worker_memory(1024), _peak_worker_memory(num_rows)
    extra = large["dataset_mib"] - small["dataset_mib"]
    return {
        "small": small,
        "large": large,
        "pss_growth_per_worker_as_fraction_of_dataset": (large["peak_pss_mib"] - small["peak_pss_mib"]) / extra,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short round (a smoke run, not a measurement)")
    parser.add_argument("--output", default=None, help="where to write the JSON results")
    args = parser.parse_args(argv)
    rounds, num_samples, epochs, memory_samples = (1, 1024, 2, 16384) if args.quick else (3, 3072, 3, 65536)
    runs: dict[str, list[dict[str, float]]] = {"torch_dp": [], "ddp_loop": [], "keras_fit": []}
    for round_index in range(rounds):
        for name, run in (("torch_dp", run_torch_dp), ("ddp_loop", run_ddp_loop), ("keras_fit", run_keras_fit)):
            runs[name].append(run(num_samples, epochs))
            print(f"round {round_index} {name}: {runs[name][-1]}", flush=True)
    ratio = lambda other: [  # noqa: E731
        mine["samples_per_s"] / theirs["samples_per_s"]
        for mine, theirs in zip(runs["torch_dp"], runs[other], strict=True)
    ]
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
        "runs": runs,
        "median_ratio_vs_ddp_loop": statistics.median(ratio("ddp_loop")),
        "median_ratio_vs_keras_fit": statistics.median(ratio("keras_fit")),
        "median_first_step_s": {name: statistics.median(r["first_step_s"] for r in rs) for name, rs in runs.items()},
        "memory": worker_memory(memory_samples),
    }
    print(f"torch_dp / hand-written DDP loop: {results['median_ratio_vs_ddp_loop']:.3f}x (target >= 0.95x)")
    print(f"torch_dp / single-process model.fit: {results['median_ratio_vs_keras_fit']:.3f}x")
    print(f"time to first step (s): {results['median_first_step_s']}")
    print(f"memory: {results['memory']}")
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
