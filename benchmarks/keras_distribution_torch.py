"""torch-dp against Keras's own torch ``keras.distribution.DataParallel`` (Keras 3.16), as a
user choosing between them meets them, on 2 CPU processes (gloo):

- Keras: 2 processes that each join the group (``MASTER_ADDR``/``RANK``/``WORLD_SIZE``, gloo)
  and call ``keras.distribution.set_distribution(keras.distribution.DataParallel())``, then
  the same ``model.fit``; Keras wraps the model in DDP and shards a ``PyDataset`` by batches,
  round-robin, so a global batch of 32 is a ``PyDataset`` of 16-row batches.
- torch-dp: ``torch_dp.Trainer(num_replicas=2).fit(model, x, y, global_batch_size=32)`` from
  one process (it starts its worker replica itself).

Correctness: a Dense + BatchNormalization model, Adam, validation data, against one-device
``model.fit`` in a fresh process: arrays, a ``PyDataset`` whose last batch is short, an even
split (weights, and BatchNorm moving statistics on each process), ``predict`` and
``evaluate``. Each Keras case runs in 2 fresh processes, a collective bounded by gloo's
timeout and the whole by a wait, after which the processes are killed (a hang).

Speed: the guides' BatchNorm convnet on random MNIST-shaped data, global batch 128, per-replica
BatchNorm on both (``batch_norm="per_replica"``: DDP's), 2 processes x 1 thread each, kept
between rounds; interleaved rounds, samples/s after the first epoch, the median of the
per-round ratios.

    python benchmarks/keras_distribution_torch.py [--quick] [--output docs/benchmarks/keras_distribution_torch.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import keras_distribution_parts as parts
import torch
from guide_convnet import compiled_batchnorm_convnet, synthetic_mnist
from machine import round_order, usable_cores
from page_sections import write_section

import torch_dp

HEADING = "## Keras's own DataParallel on torch"
OUTPUT = "docs/benchmarks/keras_distribution_torch.json"
SPEED_BATCH_SIZE = 128


def max_difference(a: list[Any], b: list[Any]) -> float:
    return max(float(abs(x - y).max()) for x, y in zip(a, b, strict=True))


def speed(rounds: int, num_samples: int, epochs: int) -> dict[str, list[float]]:
    """Samples/s of each side per round (interleaved, reversed every other round), after the first epoch."""
    trainer = torch_dp.Trainer(num_replicas=2, threads_per_replica=1, batch_norm="per_replica")
    keras_pair = parts.KerasPair()
    command = parts.SpeedCommand(num_samples, SPEED_BATCH_SIZE, epochs)

    def run_torch_dp() -> list[float]:
        clock = parts.EpochTimes()
        x, y = synthetic_mnist(num_samples)
        trainer.fit(compiled_batchnorm_convnet(), x, y, global_batch_size=SPEED_BATCH_SIZE, epochs=epochs,
                    callbacks=[clock], verbose=0)  # fmt: skip
        return clock.seconds

    contenders = {"torch_dp": run_torch_dp, "keras_data_parallel": lambda: keras_pair.run(command)}
    runs: dict[str, list[float]] = {name: [] for name in contenders}
    runs["usable_cores"] = []
    try:
        for round_index in range(rounds):
            runs["usable_cores"].append(usable_cores())
            for name, run in round_order(contenders, round_index):
                seconds = run()
                runs[name].append(num_samples * (len(seconds) - 1) / sum(seconds[1:]))
                print(f"round {round_index} {name}: {runs[name][-1]:.0f} samples/s", flush=True)
    finally:
        trainer.close()
        keras_pair.close()
    return runs


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured thing: what it is, then what each side gave."""

    measured: str
    keras_data_parallel: str
    torch_dp: str


def _number(value: float) -> str:
    return f"{value:.1e}"


def _weights_against(weights: list[Any], expected: list[Any]) -> str:
    return f"max weight difference {_number(max_difference(weights, expected))}"


def _history_difference(mine: dict[str, list[float]], theirs: dict[str, list[float]]) -> float:
    return max(abs(a - b) for name in theirs for a, b in zip(mine[name], theirs[name], strict=True))


def _evaluate_difference(mine: dict[str, float], theirs: dict[str, float]) -> float:
    return max(abs(mine[name] - theirs[name]) for name in theirs)


def _input_rows(predictions: Any, reference: Any) -> str:
    """Which input rows ``predictions`` are (each matched to its nearest row of ``reference``), as ranges."""
    import numpy as np

    indices = [int(np.abs(reference - row).sum(axis=1).argmin()) for row in predictions]
    ranges: list[list[int]] = []
    for index in indices:
        if ranges and index == ranges[-1][1] + 1:
            ranges[-1][1] = index
        else:
            ranges.append([index, index])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in ranges)


def keras_rows(reference: parts.Reference) -> tuple[dict[str, str], list[Any] | None]:
    """Each Keras DataParallel case, in 2 fresh processes, as the page's cell; and process 0's
    weights after the even split."""
    cells: dict[str, str] = {}
    even_weights = None
    for job in ("arrays", "pydataset_uneven"):
        run = parts.run_pair(job)
        cells[job] = run.outcome()
        if job == "pydataset_uneven" and run.finished():
            cells[job] += f"; {_weights_against(run.answers[0].value.weights, reference.uneven.weights)}"
    even = parts.run_pair("even")
    if even.finished():
        ranks = [even.answers[rank].value for rank in range(parts.PROCESSES)]
        even_weights = ranks[0].weights
        cells["even_weights"] = _number(max_difference(ranks[0].weights, reference.even.weights))
        cells["even_history"] = _number(_history_difference(ranks[0].history, reference.even.history))
        cells["even_moving"] = _number(max_difference(ranks[0].moving_statistics, ranks[1].moving_statistics))
    else:
        cells["even_weights"] = cells["even_history"] = cells["even_moving"] = even.outcome()
    predict = parts.run_pair("predict")
    cells["predict"] = predict.outcome()
    if predict.finished():
        cells["predict"] = "; ".join(
            f"process {rank}: {len(a.value)} rows (input rows {_input_rows(a.value, reference.predictions)})"
            for rank, a in sorted(predict.answers.items())
        )
    for job, count in (("evaluate", parts.ROWS), ("evaluate_even", parts.EVEN_ROWS)):
        run = parts.run_pair(job)
        expected = reference.evaluations[count]
        answered = [
            f"process {rank}'s result differs by {_number(_evaluate_difference(answer.value, expected))}"
            for rank, answer in sorted(run.answers.items())
            if answer.error is None
        ]
        cells[job] = "; ".join(answered if run.finished() else [run.outcome(), *answered])
    cells["even_per_replica"] = "(the first row of (c))"
    return cells, even_weights


def torch_dp_rows(reference: parts.Reference, keras_even_weights: list[Any] | None) -> dict[str, str]:
    """The same cases with ``torch_dp.Trainer(num_replicas=2)`` from this process, as the page's cells."""
    x, y = parts.rows(parts.ROWS)
    x_even, y_even = parts.rows(parts.EVEN_ROWS)
    validation = parts.validation_rows()
    common = {"epochs": parts.EPOCHS, "shuffle": False, "verbose": 0}
    cells: dict[str, str] = {}
    with torch_dp.Trainer(num_replicas=parts.PROCESSES, threads_per_replica=1) as trainer:
        model = parts.dense_bn_model()
        trainer.fit(model, x, y, global_batch_size=parts.GLOBAL_BATCH_SIZE, validation_data=validation, **common)
        cells["arrays"] = f"finished; {_weights_against(model.get_weights(), reference.uneven.weights)}"
        model = parts.dense_bn_model()
        batches = parts.Batches(x, y, parts.GLOBAL_BATCH_SIZE)  # torch-dp reads a PyDataset's batches as global ones
        trainer.fit(model, batches, validation_data=parts.Batches(*validation, parts.GLOBAL_BATCH_SIZE), **common)
        cells["pydataset_uneven"] = f"finished; {_weights_against(model.get_weights(), reference.uneven.weights)}"
        model = parts.dense_bn_model()
        history = trainer.fit(
            model, x_even, y_even, global_batch_size=parts.GLOBAL_BATCH_SIZE, validation_data=validation, **common
        )
        cells["even_weights"] = _number(max_difference(model.get_weights(), reference.even.weights))
        cells["even_history"] = _number(_history_difference(history.history, reference.even.history))
        trainer.batch_norm = "per_replica"
        model = parts.dense_bn_model()
        trainer.fit(
            model, x_even, y_even, global_batch_size=parts.GLOBAL_BATCH_SIZE, validation_data=validation, **common
        )
        trainer.batch_norm = "global"
        cells["even_per_replica"] = _weights_against(model.get_weights(), reference.even.weights) + " (`model.fit`'s)"
        if keras_even_weights is not None:
            keras_difference = _number(max_difference(model.get_weights(), keras_even_weights))
            cells["even_per_replica"] += f", {keras_difference} (Keras `DataParallel`'s process 0)"
        expected = reference.predictions
        predictions = trainer.predict(parts.dense_bn_model(), x, global_batch_size=parts.GLOBAL_BATCH_SIZE, verbose=0)
        cells["predict"] = (
            f"the calling process: {len(predictions)} rows (input rows {_input_rows(predictions, expected)}),"
            f" max difference {_number(float(abs(predictions - expected).max()))}"
        )
        for job, count in (("evaluate", parts.ROWS), ("evaluate_even", parts.EVEN_ROWS)):
            rows_x, rows_y = parts.rows(count)
            logs = trainer.evaluate(parts.dense_bn_model(), rows_x, rows_y, global_batch_size=parts.GLOBAL_BATCH_SIZE,
                                    verbose=0, return_dict=True)  # fmt: skip
            difference = _evaluate_difference(logs, reference.evaluations[count])
            cells[job] = f"the calling process's result differs by {_number(difference)}"
    # The worker replica's moving statistics are not the caller's to read: the same fit in 2
    # processes that each join the group as under torchrun, each reporting its own.
    even = parts.run_pair("torch_dp_even")
    if even.finished():
        ranks = [even.answers[rank].value for rank in range(parts.PROCESSES)]
        cells["even_moving"] = _number(max_difference(ranks[0].moving_statistics, ranks[1].moving_statistics))
    else:
        cells["even_moving"] = even.outcome()
    return cells


MEASURED = {
    "arrays": "(a) numpy arrays, `fit(x, y, validation_data=(x_val, y_val))` on 99 rows in 2 processes",
    "pydataset_uneven": (
        "(b) a `keras.utils.PyDataset` of 99 rows, last batch short (Keras: 16-row batches, 4 on process 0 and 3"
        " on process 1; torch-dp: 32-row global batches)"
    ),
    "even_weights": "(c) even split, 96 rows, 2 epochs, no shuffling: max |weights - `model.fit`'s|",
    "even_history": "(c) the same: max |History's loss, accuracy, val_loss, val_accuracy - `model.fit`'s|",
    "even_moving": "(c) the same: max |BatchNorm moving mean and variance, process 0 - process 1|",
    "even_per_replica": (
        "(c) the same, torch-dp with `batch_norm=\"per_replica\"` (each process's own statistics, as DDP's):"
        " max |weights - ...|"
    ),
    "predict": "(d) `predict` on 99 rows: rows each process gets back (matched to `model.predict`'s)",
    "evaluate": "(e) `evaluate` on 99 rows against one-device `model.evaluate` (max |difference|: loss, accuracy)",
    "evaluate_even": "(e) `evaluate` on 96 rows (an even split), the same",
}


def correctness() -> list[Row]:
    reference = parts.run_reference()
    keras_cells, keras_even_weights = keras_rows(reference)
    torch_dp_cells = torch_dp_rows(reference, keras_even_weights)
    return [Row(measured, keras_cells[key], torch_dp_cells[key]) for key, measured in MEASURED.items()]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def section(results: dict[str, Any]) -> str:
    """The page's section, from the results as written to the JSON."""
    setup, speed_results = results["setup"], results["speed"]
    medians = speed_results["median_samples_per_s"]
    ratios = speed_results["ratios_per_round"]
    cores = ", ".join(f"{c:.2f}" for c in speed_results["usable_cores"])

    def rounds(name: str) -> str:
        return ", ".join(f"{value:.0f}" for value in speed_results[name])

    lines = [
        HEADING,
        "",
        f"Keras {results['versions']['keras']} runs data parallel on torch itself: each of N processes joins a"
        " process group and calls `keras.distribution.set_distribution(keras.distribution.DataParallel())`, and"
        " `model.fit` wraps the model in DDP and shards a `PyDataset` by batches, round-robin. Here it is against"
        f" `torch_dp.Trainer(num_replicas=2)` on {setup['cores']} CPU cores, 2 processes (gloo) each side, torch"
        f" {results['versions']['torch']}.",
        "",
        "Correctness: a Dense + BatchNormalization model, Adam, validation data, global batch"
        f" {setup['global_batch_size']}"
        " (Keras: 2 processes x 16-row batches), against one-device `model.fit` in a fresh process from the same"
        " initial weights; `predict` and `evaluate` on those initial weights. Each Keras case runs in 2 fresh"
        f" processes, gloo's collective timeout {parts.COLLECTIVE_TIMEOUT_S} s, killed after {parts.PAIR_TIMEOUT_S} s"
        " (a hang). torch-dp's BatchNorm is global (its default); the moving statistics row runs its fit in 2"
        " processes that each join the group, as under torchrun, to read the worker's.",
        "",
        "| measured | Keras `DataParallel` | torch-dp |",
        "|---|---|---|",
        *(
            f"| {_cell(r['measured'])} | {_cell(r['keras_data_parallel'])} | {_cell(r['torch_dp'])} |"
            for r in results["rows"]
        ),
        "",
        f"Speed: the guides' BatchNorm convnet (`benchmarks/guide_convnet.py`), {setup['speed_samples']} random"
        f" MNIST-shaped samples, global batch {SPEED_BATCH_SIZE}, {setup['speed_epochs']} epochs (the first a"
        " warm-up), BatchNorm per replica on both (DDP's; torch-dp's `batch_norm=\"per_replica\"`), 2 processes x"
        f" 1 thread each side kept between {setup['rounds']} interleaved rounds; Keras reads a `PyDataset` of"
        " 64-row batches (it refuses arrays), torch-dp the arrays.",
        "",
        "| | samples/s (median) | rounds |",
        "|---|---|---|",
        f"| Keras `DataParallel` | {medians['keras_data_parallel']:.0f} | {rounds('keras_data_parallel')} |",
        f"| torch-dp | {medians['torch_dp']:.0f} | {rounds('torch_dp')} |",
        f"| torch-dp / Keras `DataParallel` | **{speed_results['median_ratio']:.2f}x** (median of the per-round ratios)"
        f" | {min(ratios):.2f}x to {max(ratios):.2f}x |",
        "",
        "Not broken down further, torch-dp being the faster; one difference in the code: Keras 3.16's torch"
        " trainer all-reduces each metric variable in a collective of its own at every step (its"
        " `get_metrics_result`, which the step's logs call), on top of DDP's gradient all-reduce.",
        "",
        f"Machine: {results['host']['machine']}, {setup['cores']} cores; usable cores per round"
        f" (`benchmarks/machine.py`): {cores}"
        + (
            " (shared with other jobs while this ran)."
            if min(speed_results["usable_cores"]) < 0.9 * setup["cores"]
            else "."
        ),
        "",
        "Written by `benchmarks/keras_distribution_torch.py`; raw numbers in"
        " `docs/benchmarks/keras_distribution_torch.json`.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="torch-dp against Keras's own torch DataParallel.")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: one short speed round, writes nothing under docs/"
    )
    parser.add_argument("--output", default=None, help=f"the JSON results (default {OUTPUT}, none with --quick)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved speed rounds (at least 3 for a measurement)")
    args = parser.parse_args(argv)
    rounds, num_samples, epochs = (1, 512, 2) if args.quick else (args.rounds, 2048, 3)
    rows = correctness()
    for row in rows:
        print(f"{row.measured}\n  keras: {row.keras_data_parallel}\n  torch-dp: {row.torch_dp}", flush=True)
    runs = speed(rounds, num_samples, epochs)
    ratios = [a / b for a, b in zip(runs["torch_dp"], runs["keras_data_parallel"], strict=True)]
    results = {
        "setup": {
            "global_batch_size": parts.GLOBAL_BATCH_SIZE,
            "rows": parts.ROWS,
            "even_rows": parts.EVEN_ROWS,
            "epochs": parts.EPOCHS,
            "speed_samples": num_samples,
            "speed_epochs": epochs,
            "speed_global_batch_size": SPEED_BATCH_SIZE,
            "rounds": rounds,
            "cores": os.cpu_count(),
            "quick": args.quick,
        },
        "versions": {"torch": torch.__version__, "keras": keras.__version__, "torch_dp": torch_dp.__version__},
        "host": {"machine": platform.machine(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "rows": [dataclasses.asdict(row) for row in rows],
        "speed": {
            **runs,
            "median_samples_per_s": {
                name: statistics.median(runs[name]) for name in ("torch_dp", "keras_data_parallel")
            },
            "ratios_per_round": ratios,
            "median_ratio": statistics.median(ratios),
        },
    }
    print(f"torch-dp / Keras DataParallel: {results['speed']['median_ratio']:.2f}x (rounds {ratios})", flush=True)
    output = args.output or (None if args.quick else OUTPUT)
    if output:
        with open(output, "w") as f:
            json.dump(results, f, indent=2)
    if not args.quick:
        write_section(HEADING, section(results))
    else:
        print(section(results))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
