"""Gradient accumulation: gradient bytes all-reduced per sample and throughput at k=1 and k=4.

The guides' convnet on synthetic MNIST-shaped data, 2 replicas x 1 thread, global batch 128,
Adam with ``gradient_accumulation_steps=k`` (none for k=1):

- ``torch_dp``: one ``torch_dp.Trainer(num_replicas=2, threads_per_replica=1)`` for every run;
  the bytes are counted on rank 0 (this process) at ``torch.distributed.all_reduce``, those of
  calls at least as large as the model's parameters (the gradients; BatchNorm moments, flags
  and metric states travel in small ones), and all of them;
- ``jax_dp``: ``benchmarks/jax_accumulation_parts.py``, in a fresh process per run (jax fixes
  its device count at start-up), which reads the bytes from the compiled step; in the first
  round only (each such run spends about a minute starting and compiling).

Runs are interleaved (k=1, k=4, then reversed), throughput is measured after the first epoch
from epoch timestamps, and each number reported is the median over rounds. Writes the JSON
results and the "## Gradient accumulation" section of docs/benchmarks.md.

    python benchmarks/bench_accumulation.py [--quick] [--output docs/benchmarks/accumulation.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import torch
from guide_convnet import mnist_convnet, synthetic_mnist
from machine import round_order, usable_cores
from page_sections import write_section
from torch_bench_parts import EpochClock

import torch_dp

HERE = Path(__file__).resolve().parent
JAX_PARTS = HERE / "jax_accumulation_parts.py"
GLOBAL_BATCH_SIZE = 128
STEPS = (1, 4)
JAX_TIMEOUT_S = 300
JAX_ROUNDS = 1  # a fresh process per run costs about a minute of start-up and compilation
HEADING = "## Gradient accumulation"


def convnet(k: int) -> keras.Model:
    model = mnist_convnet()
    optimizer = keras.optimizers.Adam(1e-3, gradient_accumulation_steps=k if k > 1 else None)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class AllReducedBytes:
    """Wraps ``torch.distributed.all_reduce`` in this process: bytes of every call, and of the
    calls of at least ``gradient_elements`` elements."""

    def __init__(self, gradient_elements: int) -> None:
        self.gradient_elements = gradient_elements
        self.all = self.gradients = 0
        self._all_reduce = torch.distributed.all_reduce

    def __call__(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        size = tensor.numel() * tensor.element_size()
        self.all += size
        if tensor.numel() >= self.gradient_elements:
            self.gradients += size
        return self._all_reduce(tensor, *args, **kwargs)


def run_torch_dp(trainer: torch_dp.Trainer, k: int, num_samples: int, epochs: int) -> dict[str, float]:
    x, y = synthetic_mnist(num_samples)
    model = convnet(k)
    counter = AllReducedBytes(sum(int(v.value.numel()) for v in model.trainable_variables))
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "times.json")
        torch.distributed.all_reduce = counter  # rank 0 runs in this process
        try:
            trainer.fit(
                model, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=epochs, callbacks=[EpochClock(path)], verbose=0
            )
        finally:
            torch.distributed.all_reduce = counter._all_reduce
        with open(path) as f:
            times = json.load(f)
    begin, end = times["epoch_begin"][1:], times["epoch_end"][1:]
    samples = num_samples * epochs
    return {
        "samples_per_second": num_samples * len(end) / sum(e - b for b, e in zip(begin, end, strict=True)),
        "gradient_allreduce_bytes_per_sample": counter.gradients / samples,
        "allreduce_bytes_per_sample": counter.all / samples,
    }


def run_jax_dp(k: int, num_samples: int, python: str) -> dict[str, float] | None:
    """One jax_dp measurement in a fresh process with 2 host devices; None (and why, on stderr) if it fails."""
    environment = {**os.environ, "KERAS_BACKEND": "jax", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    command = [python, str(JAX_PARTS), "--k", str(k), "--samples", str(num_samples)]
    try:
        done = subprocess.run(
            command, env=environment, cwd=HERE, capture_output=True, text=True, timeout=JAX_TIMEOUT_S, check=True
        )
    except (subprocess.SubprocessError, OSError) as error:
        details = getattr(error, "stderr", "") or ""
        print(f"jax_dp k={k} failed: {error}\n{details[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def summary(runs: dict[str, dict[int, list[dict[str, float]]]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per backend and k, the median over rounds of each measured number."""
    return {
        backend: {str(k): {key: _median(rs, key) for key in rs[0]} for k, rs in by_k.items() if rs}
        for backend, by_k in runs.items()
    }


def section(results: dict[str, Any]) -> str:
    """The page section: one row per backend and k, and what the numbers mean."""
    rows = []
    for backend, by_k in results["median"].items():
        base = by_k.get("1", {}).get("samples_per_second")
        for k, numbers in by_k.items():
            total = numbers["allreduce_bytes_per_sample"]
            gradient_bytes = numbers.get("gradient_allreduce_bytes_per_sample", total)
            speedup = f"{numbers['samples_per_second'] / base:.2f}x" if base else "-"
            rows.append(
                f"| {backend} | {k} | {gradient_bytes:,.0f} | {total:,.0f} "
                f"| {numbers['samples_per_second']:,.0f} | {speedup} |"
            )
    setup = results["setup"]
    jax_note = (
        ""
        if "jax_dp" in results["median"]
        else "\njax_dp is not in this run: its measurement did not complete (see the script's output).\n"
    )
    return f"""{HEADING}

`gradient_accumulation_steps=k` on the model's optimizer: each replica accumulates its share of
the gradients for k-1 steps without any gradient collective, and the k-th step all-reduces the
window's sum once; the update is Keras's single-device one. The guides' convnet, synthetic
MNIST-shaped data, 2 replicas x 1 thread, global batch {setup["global_batch_size"]}, Adam,
{setup["num_samples"]} samples x {setup["epochs"]} epochs (the first is warm-up). torch_dp: median of
{setup["rounds"]} interleaved rounds; jax_dp: {setup["jax_rounds"]} round(s), each run in a fresh process.
{setup["cpu_count"]} cores, {setup["median_usable_cores"]:.1f} usable during the runs (the machine is shared).
torch_dp's bytes are counted at `torch.distributed.all_reduce` on rank 0: the gradient column
counts the calls as large as the model's parameters, the total also counts BatchNorm moments,
flags and metric states; jax_dp's come from its compiled step (its gradient column is its total).

| backend | k | gradient bytes all-reduced / sample | all bytes all-reduced / sample | samples/s | vs k=1 |
| --- | --- | --- | --- | --- | --- |
{chr(10).join(rows)}
{jax_note}
Written by `benchmarks/bench_accumulation.py`; results in `docs/benchmarks/accumulation.json`.
"""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer samples and rounds, nothing written")
    parser.add_argument("--output", default=str(HERE.parent / "docs" / "benchmarks" / "accumulation.json"))
    parser.add_argument("--jax-python", default=sys.executable, help="the Python that has jax and jax-dp")
    args = parser.parse_args(argv)
    num_samples, epochs, rounds = (512, 2, 1) if args.quick else (2048, 3, 3)
    runs: dict[str, dict[int, list[dict[str, float]]]] = {"torch_dp": {k: [] for k in STEPS}}
    if JAX_PARTS.exists():
        runs["jax_dp"] = {k: [] for k in STEPS}
    cores = []
    with torch_dp.Trainer(num_replicas=2, threads_per_replica=1) as trainer:
        for round_index in range(rounds):
            cores.append(usable_cores())  # other jobs on the machine show here
            for _, k in round_order({str(k): k for k in STEPS}, round_index):
                runs["torch_dp"][k].append(run_torch_dp(trainer, k, num_samples, epochs))
                print(f"round {round_index} torch_dp k={k}: {runs['torch_dp'][k][-1]}", flush=True)
                if "jax_dp" in runs and round_index < JAX_ROUNDS:
                    measured = run_jax_dp(k, num_samples, args.jax_python)
                    if measured is not None:
                        runs["jax_dp"][k].append(measured)
                        print(f"round {round_index} jax_dp k={k}: {measured}", flush=True)
    results = {
        "setup": {
            "global_batch_size": GLOBAL_BATCH_SIZE,
            "num_samples": num_samples,
            "epochs": epochs,
            "rounds": rounds,
            "jax_rounds": min(rounds, JAX_ROUNDS),
            "num_replicas": 2,
            "cpu_count": os.cpu_count(),
            "median_usable_cores": statistics.median(cores),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "keras": keras.__version__,
        },
        "median": summary(runs),
        "runs": {backend: {str(k): rs for k, rs in by_k.items()} for backend, by_k in runs.items()},
    }
    if "jax_dp" in results["median"] and len(results["median"]["jax_dp"]) < len(STEPS):
        del results["median"]["jax_dp"]  # a row without its k=1 baseline (or k=4) compares nothing
    print(json.dumps(results["median"], indent=2))
    if not args.quick:
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
        write_section(HEADING, section(results))
    return results


if __name__ == "__main__":
    main()
