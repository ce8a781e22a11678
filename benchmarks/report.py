"""Turn the benchmark JSON into docs/benchmarks.md and its plots.

    python benchmarks/report.py [--results docs/benchmarks] [--output docs/benchmarks.md]

Reads ``torch.json`` (bench_torch.py), ``jax.json`` (bench_jax.py) and ``interactive.json``
(bench_interactive.py); writes a table of ratios against each baseline and target, weak-scaling,
interactive-call and memory sections, the machine and versions, and two PNG plots next to the
JSON: ``throughput.png`` and ``scaling.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

import gpu_check  # this folder is on the path when the script runs
import page_sections

THROUGHPUT_TARGETS = {("torch", "ddp_loop"): 0.95, ("jax", "guide_loop"): 1.0, ("jax", "keras_data_parallel"): 1.0}
CEILING_TARGET = 0.95  # weak scaling: 2 replicas' samples/s over two lone processes' (the machine's ceiling)
KERAS_DISTRIBUTION_TARGET = 1.0  # jax_dp / keras.distribution + model.fit, at these global batches
KERAS_DISTRIBUTION_TARGET_BATCHES = (64, 128)
# "One copy of the data however many workers": a growth nearer one copy than two. What
# goes beyond one copy (batches in flight, allocator slack) is listed under shortfalls.
MEMORY_TARGET = 1.5
MEMORY_EXCESS_NOTED = 1.1
# Interactive calls (bench_interactive.py): seconds at most, and the batch-callback throughput ratio.
EVALUATE_PREDICT_AFTER_FIT_S = {"torch": 1.0}
SECOND_FIT_FIRST_STEP_S = {"torch": 1.0, "jax": 0.3}
BATCH_CALLBACK_RATIO = 0.95
BACKENDS = ("torch", "jax")
# written by their own scripts (benchmarks/page_sections.py), kept when this page is rewritten
KEPT_SECTIONS = (
    "## Gradient accumulation",
    "## Scaling report",
    "## Synchronized BatchNorm",
    "## Model parallel: memory per device",
    "## Sharded state on torch: memory per replica",
    "## Sharded state on jax: memory per device",
    "## Keras's own DataParallel on torch",
    "## steps_per_execution: a Trainer against model.fit",
)
# What the per-step timers of a Trainer's loop with a batch callback leave out.
REST_OF_LOOP = {
    "torch": "is the loop's other per-step work and the rounds' noise, not broken down further",
    "jax": (
        "is the loop's other per-step work for a batch callback (the hooks run with the model holding the"
        " current state, before the next step starts, as in `model.fit`), not broken down further"
    ),
}
# What a Trainer does to produce a step's logs for the caller, for the per-step table.
TRAINER_LOGS = {
    "torch": "rank 0 computes the logs from the metric states summed over the replicas, in `logs_of`",
    "jax": (
        "the logs are copied from the devices, which waits for the step and its reporting work (the replicas'"
        " metric states summed: a second cross-device all-reduce), in `report_on_host`"
    ),
}
BASELINE_NAMES = {
    "ddp_loop": "Keras guide's DDP loop (torch optimizer and loss, no metrics, Dropout off)",
    "ddp_loop_keras_work": "the same DDP loop doing torch_dp's work (Keras loss, optimizer, metric; Dropout on)",
    "keras_fit": "single-process `model.fit`",
    "guide_loop": "Keras guide's jitted sharded loop (no metrics)",
    "keras_data_parallel": "`keras.distribution.DataParallel` + `model.fit`",
}


def _verdict(value: float, target: float | None, *, at_most: bool = False, unit: str = "x") -> str:
    if target is None:
        return "—"
    if (value <= target) if at_most else (value >= target):
        return "met"
    return f"**not met** (target {'≤' if at_most else '≥'} {target:.2f}{unit})"


def _against(value: float, target: float) -> str:
    """``value`` to 2 decimals, or to 3 where 2 would round it onto the other side of ``target``."""
    shown = f"{value:.2f}"
    return f"{value:.3f}" if (float(shown) >= target) != (value >= target) else shown


def throughput_rows(backend: str, ratios: list[tuple[str, float]]) -> list[str]:
    lines = []
    for baseline, ratio in ratios:
        verdict = _verdict(ratio, THROUGHPUT_TARGETS.get((backend, baseline)))
        lines.append(f"| {backend}_dp samples/s | {BASELINE_NAMES[baseline]} | {ratio:.2f}x | {verdict} |")
    return lines


def summary_table(torch_results: dict[str, Any], jax_results: dict[str, Any]) -> list[str]:
    torch_ratios = [
        ("ddp_loop", torch_results["median_ratio_vs_ddp_loop"]),
        ("ddp_loop_keras_work", torch_results["median_ratio_vs_ddp_loop_keras_work"]),
        ("keras_fit", torch_results["median_ratio_vs_keras_fit"]),
    ]
    jax_ratios = list(jax_results["median_ratio_jax_dp_over"].items())
    memory = torch_results["memory"]
    workers = memory["pss_growth_of_workers_as_fraction_of_dataset"]
    jax_memory = jax_results["memory"]["peak_rss_growth_as_fraction_of_dataset"]
    lines = [
        "| measure | against | median | target |",
        "|---|---|---|---|",
        *throughput_rows("torch", torch_ratios),
        *throughput_rows("jax", jax_ratios),
    ]
    for batch, setting, ratio in keras_distribution_ratios(jax_results):
        if batch in KERAS_DISTRIBUTION_TARGET_BATCHES:
            lines.append(
                f"| jax_dp samples/s, BatchNorm convnet, global batch {batch}, {SETTING_NAMES[setting]}"
                f" | `keras.distribution.DataParallel` + `model.fit`, the same | {ratio:.2f}x"
                f" | {_verdict(ratio, KERAS_DISTRIBUTION_TARGET)} |"
            )
    for backend, results in (("torch", torch_results), ("jax", jax_results)):
        scaling = results["weak_scaling"]
        verdict = _verdict(scaling["median_of_ceiling"], CEILING_TARGET).replace("x)", ")")
        lines.append(
            f"| {backend}_dp weak scaling, 1 → 2 replicas | the machine's ceiling: two lone 1-replica processes at once"
            f" | {scaling['median_of_ceiling']:.2f} | {verdict} |"
        )
    lines += [
        f"| torch_dp memory growth, 2 workers together, {memory['large']['dataset_mib']:.0f} MiB array"
        f" | one copy of the data | {workers:.2f}x | {_verdict(workers, MEMORY_TARGET, at_most=True)} |",
        f"| jax_dp memory growth, 1 process / 2 devices, {jax_results['memory']['dataset_mib']:.0f} MiB array"
        f" | one copy of the data | {jax_memory:.2f}x | {_verdict(jax_memory, MEMORY_TARGET, at_most=True)} |",
    ]
    return lines


SETTING_NAMES = {
    "none": "no batch callback",
    "batch_callback": "a logs-only batch callback on both",
    "progress_bar": "`verbose=1` on both",
}


def keras_distribution_ratios(jax_results: dict[str, Any]) -> list[tuple[int, str, float]]:
    measured = jax_results["keras_distribution"]["by_batch_and_setting"].values()
    return [(m["global_batch_size"], m["setting"], m["median_ratio"]) for m in measured]


def keras_distribution_section(jax_results: dict[str, Any]) -> list[str]:
    versus = jax_results["keras_distribution"]
    lines = [
        "## jax-dp against `keras.distribution`, like for like",
        "",
        "What a Keras-on-JAX user has for free: `keras.distribution.set_distribution(DataParallel(...))` and",
        f"`model.fit`, against `jax_dp.Trainer(2).fit`, on {versus['model']} ({versus['data']}), {versus['devices']};",
        "the same seeded model on both sides, in three settings: no batch-level callback, a callback that reads",
        "each step's logs (`LambdaCallback(on_train_batch_end=lambda batch, logs: logs['loss'])`), and the Keras",
        "progress bar (`verbose=1`, its output to `os.devnull` on both sides). Each cell is the median over"
        f" {versus['rounds']} interleaved rounds",
        "of each round's ratio of samples/s (each run over its median epoch after the first, which compiles);"
        f" the target is ≥ {KERAS_DISTRIBUTION_TARGET:.1f}x at global batches"
        f" {' and '.join(map(str, KERAS_DISTRIBUTION_TARGET_BATCHES))} (`benchmarks/jax_vs_keras.py`).",
        "",
        "| global batch | " + " | ".join(SETTING_NAMES[s] for s in ("none", "batch_callback", "progress_bar")) + " |",
        "|---|---|---|---|",
    ]
    by_batch: dict[int, dict[str, Any]] = {}
    for m in versus["by_batch_and_setting"].values():
        by_batch.setdefault(m["global_batch_size"], {})[m["setting"]] = m
    for batch, settings in sorted(by_batch.items()):
        cells = []
        for setting in ("none", "batch_callback", "progress_bar"):
            m = settings[setting]
            jax_dp = statistics.median(m["samples_per_second"]["jax_dp"])
            keras_side = statistics.median(m["samples_per_second"]["keras_distribution"])
            cells.append(f"{m['median_ratio']:.2f}x ({jax_dp:.0f} vs {keras_side:.0f} samples/s)")
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    return lines


def torch_medians(results: dict[str, Any]) -> dict[str, float]:
    """Median samples/s of the 2-replica contenders (the 1-replica run is in the scaling plot)."""
    return {
        name: statistics.median(r["samples_per_s"] for r in runs)
        for name, runs in results["runs"].items()
        if name not in ("torch_dp_1_replica", "lone_pair")
    }


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(medians: dict[str, dict[str, float]], path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(medians), figsize=(5 * len(medians), 3.6))
    for axis, (backend, values) in zip(axes, medians.items(), strict=True):
        names = list(values)
        axis.bar(names, [values[n] for n in names], color=["tab:blue" if "_dp" in n else "tab:gray" for n in names])
        axis.set(title=f"{backend}: median samples/s", ylabel="samples/s")
        axis.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_scaling(scaling: dict[str, dict[str, Any]], path: Path) -> None:
    """Measured samples/s at 1 and 2 replicas against the ideal (twice the 1-replica value)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(scaling), figsize=(4.5 * len(scaling), 3.6))
    for axis, (backend, results) in zip(axes, scaling.items(), strict=True):
        one, two = results["median_samples_per_s"]["1"], results["median_samples_per_s"]["2"]
        axis.plot([1, 2], [one, 2 * one], "--", color="tab:gray", label="ideal (linear)")
        axis.plot([1, 2], [one, two], "o-", color="tab:blue", label=f"{backend}_dp measured")
        axis.annotate(
            f"efficiency {results['median_efficiency']:.2f}",
            (2, two),
            textcoords="offset points",
            xytext=(-10, -18),
            ha="right",
        )
        axis.set(
            title=f"{backend}_dp weak scaling, 1 thread per replica",
            xlabel="replicas",
            ylabel="samples/s",
            xticks=[1, 2],
            ylim=(0, 2.2 * one),
        )
        axis.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def scaling_section(torch_results: dict[str, Any], jax_results: dict[str, Any]) -> list[str]:
    torch_scaling, jax_scaling = torch_results["weak_scaling"], jax_results["weak_scaling"]
    lines = [
        "## Weak scaling, 1 → 2 replicas",
        "",
        "Efficiency is samples/s on 2 replicas divided by twice the samples/s on 1, with the same",
        f"per-replica batch ({torch_scaling['per_replica_batch_size']}) and the same number of samples per replica,",
        "1 thread per replica; the median over interleaved rounds of each round's ratio. The machine's ceiling is",
        "two lone 1-replica processes that share nothing, run at once, each on a core of its own: the samples/s two",
        "replicas could reach here without any communication. *Of the ceiling* is 2 replicas' samples/s over theirs,"
        f" in the same round (goal ≥ {CEILING_TARGET}).",
        "",
        "| backend | samples per replica | samples/s, 1 replica | samples/s, 2 replicas | efficiency"
        " | two lone processes (efficiency) | of the ceiling | rounds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for backend, scaling, rounds in (
        ("torch_dp", torch_scaling, torch_results["setup"]["rounds"]),
        ("jax_dp", jax_scaling, len(jax_scaling["efficiency_per_round"])),
    ):
        medians = scaling["median_samples_per_s"]
        pair = scaling["lone_pair_samples_per_s"]
        pair = statistics.median(pair) if isinstance(pair, list) else pair
        lines.append(
            f"| {backend} | {scaling['samples_per_replica']} | {medians['1']:.0f} | {medians['2']:.0f}"
            f" | {scaling['median_efficiency']:.2f} | {pair:.0f} ({scaling['lone_pair_efficiency']:.2f})"
            f" | {scaling['median_of_ceiling']:.2f} | {rounds} |"
        )
    lines += [
        "",
        "![weak scaling](benchmarks/scaling.png)",
        "",
        "- The ceiling, torch: 2 spawned single-thread `torch_dp.Trainer(num_replicas=1)` processes at the"
        " per-replica batch, one run in each round;",
        "  jax: 2 `jax_dp.Trainer(1)` processes, each pinned to one core, XLA single-threaded, one run in each round.",
        "- torch_dp: `Trainer(num_replicas=2, threads_per_replica=1)` (2 spawned processes x 1 thread,",
        "  gloo all-reduce) against `Trainer(num_replicas=1)`, which trains in the calling process,",
        "  here held to 1 thread with `torch.set_num_threads(1)`. These are the runs of the throughput",
        "  rounds above, the 1-replica run on half the samples at half the global batch.",
        "- jax_dp: jax cannot give each CPU device its own thread inside one process, so each run is",
        "  a fresh process (`benchmarks/jax_bench_parts.py`) with",
        f'  `XLA_FLAGS="{jax_scaling["xla_flags"]}"` (N = 1 or 2) and its CPU',
        "  affinity set to N cores before jax starts: XLA's CPU ops run single-threaded and the",
        "  process can use only N cores. jax-dp is `Trainer(N)` at a global batch of 64 x N.",
        *_no_communication_lines(jax_scaling),
    ]
    return lines


def kept_heap_section(jax_results: dict[str, Any]) -> list[str]:
    """jax on CPU with glibc's malloc told to keep its heap (``bench_jax.kept_heap``)."""
    measured = jax_results.get("kept_heap")
    if measured is None:
        return []
    runs = measured["samples_per_second"]
    variables = " ".join(f"{name}={value}" for name, value in measured["environment"].items())
    rounds = ", ".join(f"{ratio:.2f}x" for ratio in measured["ratio_per_round"])
    return [
        "## jax on CPU: glibc's allocator",
        "",
        "XLA:CPU takes each device's temporary buffers for a step (tens of MB for this convnet) from malloc"
        " and frees them after the step. glibc serves blocks that large with a fresh `mmap` and returns them"
        " with `munmap`, so every step page-faults its buffers in again, on cores the devices compute on."
        f" Started with `{variables}` in its environment, glibc keeps them in its heap for the next step:"
        f" `jax_dp.Trainer(2)` on the weak-scaling runs' convnet (2 devices, 1 core and 1 XLA thread each)"
        f" trained at {statistics.median(runs['kept_heap']):.0f} against {statistics.median(runs['default']):.0f}"
        f" samples/s, **{measured['median_ratio']:.2f}x** (median of {len(measured['ratio_per_round'])}"
        f" interleaved rounds: {rounds}).",
        "",
        "These are process-wide settings for the C library, so jax-dp does not make them itself: the freed"
        " memory stays with the process (up to the trim threshold) and every thread shares one arena. Every"
        " other number on this page runs with glibc's defaults.",
        "",
    ]


def _no_communication_lines(scaling: dict[str, Any]) -> list[str]:
    """What XLA's CPU runtime leaves of the ceiling with 2 devices in one process, by itself."""
    measured = scaling.get("no_communication")
    if measured is None:
        return []
    runs = measured["samples_per_second"]
    return [
        "- jax, 2 devices in one process, without jax-dp: the same convnet's step with no communication at all"
        " (each device trains its own copy on a batch of its own, placed once; `shard_map`, no all-reduce;"
        " `jax_bench_parts.no_communication`) reaches"
        f" {measured['median_one_process_of_ceiling']:.2f} of two lone processes of it"
        f" ({statistics.median(runs['one_process']):.0f} against {statistics.median(runs['lone_pair']):.0f}"
        " samples/s, medians): that much of the ceiling is XLA's CPU runtime running 2 devices in one process,"
        " before any data-parallel work. jax-dp's 2 replicas, with their all-reduce and input, run at"
        f" {measured['median_jax_dp_of_one_process']:.2f}x that program.",
    ]


def memory_section(torch_results: dict[str, Any], jax_results: dict[str, Any]) -> list[str]:
    memory = torch_results["memory"]
    large, small = memory["large"], memory["small"]
    jax_memory = jax_results["memory"]
    per_worker = ", ".join(f"{p:.0f}" for p in large["peak_pss_per_worker_mib"])
    return [
        "## Memory for a large array dataset",
        "",
        f"A {large['dataset_mib']:.0f} MiB dataset (float32 rows of 4096 columns and int64 labels), one epoch of a",
        f"linear classifier at a global batch of {memory['global_batch_size']}, so the memory is about the data,"
        " not the model.",
        "",
        "torch_dp, 2 workers (peak PSS, which splits a shared page between the processes that map it;",
        "growth is the difference from the same run on one batch of rows):",
        "",
        "| process | peak PSS (MiB) | growth as a fraction of the dataset |",
        "|---|---|---|",
        f"| each worker | {per_worker} | {memory['pss_growth_per_worker_as_fraction_of_dataset']:.2f}x (largest) |",
        f"| both workers | {sum(large['peak_pss_per_worker_mib']):.0f}"
        f" | {memory['pss_growth_of_workers_as_fraction_of_dataset']:.2f}x |",
        f"| caller (holds the user's array) | {large['peak_parent_pss_mib']:.0f}"
        f" | {memory['pss_growth_of_parent_as_fraction_of_dataset']:.2f}x |",
        f"| all processes | {large['peak_total_pss_mib']:.0f}"
        f" | {memory['pss_growth_in_total_as_fraction_of_dataset']:.2f}x |",
        "",
        "torch_dp writes each array once to a `.npy` file that every worker memory-maps: the workers",
        "share one copy however many there are. Each worker's RSS counts every page of the file it",
        f"has mapped (it grew by {memory['rss_growth_per_worker_as_fraction_of_dataset']:.2f}x the dataset), its PSS"
        " only its share of them.",
        "The total is that copy plus the caller's own array (with the one-batch run at"
        f" {small['peak_total_pss_mib']:.0f} MiB",
        "in total, mostly the imported libraries of 3 processes).",
        "",
        f"jax_dp, one process feeding 2 devices: peak RSS {jax_memory['peak_rss_mib']:.0f} MiB against"
        f" {jax_memory['baseline_rss_mib']:.0f} MiB",
        "after a warm-up fit on one batch (libraries and a compiled step loaded), a growth of",
        f"{jax_memory['peak_rss_growth_as_fraction_of_dataset']:.2f}x the dataset, which itself is allocated in that"
        " process.",
    ]


def _duration(seconds: float) -> str:
    """A measured time; a time to the first step can come out below zero (the first epoch's steps ran
    faster than every later epoch's), which says only that it is too short to tell: ~0."""
    return f"{seconds:.3f}" if seconds >= 0 else "~0"


def _started(results: dict[str, Any], call: str) -> tuple[float, list[float]]:
    """A Trainer's first ``call`` once its first fit started it, and its later ``call`` times.

    The cycle is fit -> evaluate -> predict, repeated: the first fit is the new Trainer's first
    call, so for fit the first call once started is the second.
    """
    seconds = results["trainer"][call]
    first = 1 if call.startswith("fit") else 0
    return seconds[first], seconds[first + 1 :]


CALLBACK_KINDS = {"median_ratio": "a logs-only batch callback", "progress_bar_median_ratio": "the progress bar"}


def callback_target(keras_ratio: float) -> tuple[float, str]:
    """A batch callback's throughput target: at least ``BATCH_CALLBACK_RATIO`` of none, or at most what it
    costs plain ``model.fit``, whichever is looser; and which one that is."""
    if keras_ratio < BATCH_CALLBACK_RATIO:
        return keras_ratio, "target: model.fit's own cost, the looser"
    return BATCH_CALLBACK_RATIO, f"target: {BATCH_CALLBACK_RATIO}x, the looser"


def interactive_targets(interactive: dict[str, Any]) -> list[str]:
    """A row for each target of the interactive calls, in the summary table's form."""
    lines = ["| measure | measured | for comparison | target |", "|---|---|---|---|"]
    for backend, limit in EVALUATE_PREDICT_AFTER_FIT_S.items():
        results = interactive[backend]
        for call in ("evaluate", "predict"):
            seconds, _ = _started(results, call)
            lines.append(
                f"| {backend}_dp `{call}` right after the first `fit` | {seconds:.2f} s"
                f" | a new Trainer's first call: {results['new_trainer'][call]:.1f} s"
                f" | {_verdict(seconds, limit, at_most=True, unit=' s')} |"
            )
    for backend, limit in SECOND_FIT_FIRST_STEP_S.items():
        results = interactive[backend]
        seconds, _ = _started(results, "fit_first_step")
        lines.append(
            f"| {backend}_dp second `fit`, call to its first step | {_duration(seconds)} s"
            f" | the first `fit`: {results['new_trainer']['fit_first_step']:.1f} s"
            f" | {_verdict(seconds, limit, at_most=True, unit=' s')} |"
        )
    for backend in BACKENDS:
        measured = interactive[backend]["throughput"]
        for key, label in CALLBACK_KINDS.items():
            ratio, keras_ratio = measured["trainer"][key], measured["keras"][key]
            target, which = callback_target(keras_ratio)
            lines.append(
                f"| {backend}_dp samples/s with {label}, over without | {_against(ratio, target)}x"
                f" | plain `model.fit`: {keras_ratio:.2f}x | {_verdict(ratio, target)} ({which}) |"
            )
    return lines


def interactive_calls_table(interactive: dict[str, Any]) -> list[str]:
    lines = [
        "| backend | call | `model.*`, first call | `model.*`, later | Trainer: a new Trainer's first call"
        " | Trainer: first call once started | Trainer: later | later: Trainer less `model.*` |",
        "|---|---|---|---|---|---|---|---|",
    ]
    names = {
        "fit": f"`fit`, {interactive['setup']['fit_epochs']} epochs",
        "fit_first_step": "`fit`, to its first step",
        "evaluate": "`evaluate`",
        "predict": "`predict`",
    }
    for backend in BACKENDS:
        results = interactive[backend]
        for call, name in names.items():
            keras_seconds = results["keras"][call]
            keras_later = statistics.median(keras_seconds[1:])
            started, later = _started(results, call)
            trainer_later = statistics.median(later)
            lines.append(
                f"| {backend}_dp | {name} | {_duration(keras_seconds[0])} | {_duration(keras_later)}"
                f" | {_duration(results['new_trainer'][call])} | {_duration(started)} | {_duration(trainer_later)}"
                f" | {trainer_later - keras_later:+.3f} |"
            )
    return lines


def interactive_throughput_table(interactive: dict[str, Any]) -> list[str]:
    lines = [
        "| backend | who | samples/s without | samples/s with | with / without (median) | per round | epochs a run"
        " | rounds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for backend in BACKENDS:
        for who, label in (("trainer", f"{backend}_dp.Trainer(2)"), ("keras", "`model.fit`")):
            measured = interactive[backend]["throughput"][who]
            runs = measured["samples_per_s"]
            per_round = ", ".join(f"{r:.2f}" for r in measured["ratio_per_round"])
            without, with_callback = statistics.median(runs["without"]), statistics.median(runs["with"])
            lines.append(
                f"| {backend} | {label} | {without:.0f} | {with_callback:.0f} | {measured['median_ratio']:.2f}x"
                f" | {per_round} | {measured['epochs_per_run']}"
                f" | {len(measured['ratio_per_round'])} |"
            )
        bare = interactive[backend]["throughput"]["trainer"].get("bare_step")
        if bare is not None:  # jax: the same model's bare jitted step, waiting for each loss or not
            runs, per_round = bare["samples_per_s"], ", ".join(f"{r:.2f}" for r in bare["ratio_per_round"])
            lines.append(
                f"| {backend} | a bare jitted step, waiting for each step's loss (`jax_bare_step`)"
                f" | {statistics.median(runs['back_to_back']):.0f} | {statistics.median(runs['waiting']):.0f}"
                f" | {bare['median_ratio']:.2f}x | {per_round} | {bare['epochs_per_run']}"
                f" | {len(bare['ratio_per_round'])} |"
            )
    return lines


def interactive_breakdown_table(interactive: dict[str, Any]) -> list[str]:
    lines = [
        "| backend | callback | step | producing the logs | callbacks' batch-end calls | torch_dp's `train_step` |",
        "|---|---|---|---|---|---|",
    ]
    for backend in BACKENDS:
        for variant, per_step in interactive[backend]["throughput"]["trainer"]["per_step"].items():
            train_step = f"{per_step['train_step_ms']:.2f}" if "train_step_ms" in per_step else "—"
            lines.append(
                f"| {backend}_dp | {variant} | {per_step['step_ms']:.2f} | {per_step['trainer_logs_ms']:.2f}"
                f" | {per_step['callbacks_ms']:.2f} | {train_step} |"
            )
    lines += [
        "",
        *(f"- producing the logs, {backend}: {text}." for backend, text in TRAINER_LOGS.items()),
        "- callbacks' batch-end calls: Keras's `CallbackList.on_train_batch_end`, which hands each call to a"
        " thread when no callback has a batch-end hook (as in the runs without the callback) and calls the"
        " hooks in the loop otherwise. Plain `model.fit` goes the same two ways.",
    ]
    faster = [b for b in BACKENDS if interactive[b]["throughput"]["keras"]["median_ratio"] > 1.0]
    if faster:
        lines.append(
            f"- Plain `model.fit` ran faster with the callback than without on {' and '.join(faster)}; why was not"
            " examined further."
        )
    return lines


def interactive_machine(interactive: dict[str, Any]) -> str:
    parts = []
    for backend in BACKENDS:
        results = interactive[backend]
        rounds = results["throughput"]
        cores = [results["usable_cores_at_start"], *rounds["trainer"]["usable_cores"], *rounds["keras"]["usable_cores"]]
        names = {"keras": "Keras", "torch_dp": "torch-dp", "jax_dp": "jax-dp"}
        versions = ", ".join(f"{names.get(name, name)} {version}" for name, version in results["versions"].items())
        parts.append(
            f"{backend} ({versions}): load average {results['load_average_at_start'][0]:.1f} at its start,"
            f" usable cores median {statistics.median(cores):.2f} (lowest {min(cores):.2f})"
        )
    return "; ".join(parts)


def interactive_section(interactive: dict[str, Any]) -> list[str]:
    setup = interactive["setup"]
    return [
        "## Interactive calls: a Trainer kept between calls",
        "",
        "`benchmarks/bench_interactive.py`, in a run of its own (the machine it had is at the end of this",
        f"section). A small model ({setup['model']})",
        f"on {setup['rows']:,} rows at a global batch of {setup['global_batch_size']}, so that a call's time is the"
        " trainer's, not the model's:",
        f"`torch_dp.Trainer(num_replicas={setup['num_replicas']})` (this process is replica 0, plus one worker"
        " process) and `jax_dp.Trainer(2)`",
        "(2 forced host devices in one process), each backend in a process of its own, against plain Keras",
        "(`model.fit`, `model.evaluate`, `model.predict`: one process, one device). One model goes through",
        f"`fit` ({setup['fit_epochs']} epochs) → `evaluate` → `predict` three times; the Trainer's first `fit`"
        " starts its worker (torch) or",
        "compiles its train step (jax). Seconds from the call to its return; `evaluate` and `predict` are also",
        "timed as the first call of a new Trainer.",
        "",
        *interactive_targets(interactive),
        "",
        "Before a `torch_dp.Trainer` kept its workers, every call started them anew: 13 to 17 s for each",
        "`evaluate` and `predict` on these 2 CPU replicas. Before a `jax_dp.Trainer` kept its compiled steps,",
        "every `fit` compiled them again (3.5 s to the first step of the convnet above).",
        "",
        "### Seconds per call",
        "",
        *interactive_calls_table(interactive),
        "",
        "- A `fit`'s time to its first step: from the call until its steps run at steady speed, that is the end",
        "  of its first epoch less its shortest later epoch (so more than the start-up alone, unless the first",
        f"  epoch's steps ran faster than all the later ones; later epochs of one `fit` differ by up to"
        f" {_epoch_spread(interactive):.3f} s).",
        "  The clock is a callback with epoch hooks only: a batch hook would make both trainers bring the logs",
        "  to the caller at every step, which is what the next table measures.",
        "- First call once started: the Trainer has run a `fit` (the cycle's first) and is called again; for",
        "  `fit` that is the second `fit`, for `evaluate` and `predict` the call right after the first `fit`.",
        "  Later: the median of the calls after that one (`model.*`: of every call after its first).",
        "- torch: a started Trainer's worker holds the model and the arrays it was sent, and a later call sends",
        "  it the job (and the model's state only when it changed since). jax: a Trainer compiles each kind of",
        "  step at its first use and keeps it for the model, so `evaluate` and `predict` compile theirs at their",
        "  first call.",
        "",
        "### Throughput with a batch-level callback",
        "",
        '`fit` with and without `keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: logs["loss"])`,',
        "on the started Trainer above and on plain `model.fit`, in interleaved rounds (in reverse order every",
        "other round), each run's samples/s from its median epoch after the first; the ratio is the median of",
        "the per-round ratios.",
        "",
        *interactive_throughput_table(interactive),
        "",
        "Where a Trainer's step goes in those runs (milliseconds per step, medians over the rounds; timing",
        "wrappers in the calling process, about a microsecond a call):",
        "",
        *interactive_breakdown_table(interactive),
        "",
        f"Machine during this run: {interactive_machine(interactive)}.",
    ]


def _epoch_spread(interactive: dict[str, Any]) -> float:
    """The largest difference between two later epochs of one Trainer ``fit``: the resolution of the
    time to the first step."""
    return max(
        max(epochs[1:]) - min(epochs[1:])
        for backend in BACKENDS
        for epochs in interactive[backend]["trainer"]["fit_epoch_s"]
    )


def interactive_shortfalls(interactive: dict[str, Any]) -> list[str]:
    """A line for each interactive target not met, with what the measurements show of its cause."""
    lines = []
    for backend, limit in EVALUATE_PREDICT_AFTER_FIT_S.items():
        for call in ("evaluate", "predict"):
            seconds, later = _started(interactive[backend], call)
            if seconds > limit:
                lines.append(
                    f"- {backend}-dp `{call}` right after the first `fit`, {seconds:.2f} s > {limit} s; its later"
                    f" calls take {statistics.median(later):.2f} s: the first call's extra time is its start-up."
                )
    for backend, limit in SECOND_FIT_FIRST_STEP_S.items():
        seconds, later = _started(interactive[backend], "fit_first_step")
        if seconds > limit:
            lines.append(
                f"- {backend}-dp second `fit` to its first step, {seconds:.2f} s > {limit} s (later `fit`s:"
                f" {statistics.median(later):.2f} s)."
            )
    for backend in BACKENDS:
        measured = interactive[backend]["throughput"]
        if measured["trainer"]["median_ratio"] < callback_target(measured["keras"]["median_ratio"])[0]:
            lines.append(_callback_shortfall(backend, measured))
        bar = measured["trainer"]["progress_bar_median_ratio"]
        keras_bar = measured["keras"]["progress_bar_median_ratio"]
        if bar < (target := callback_target(keras_bar)[0]):
            rounds = ", ".join(f"{v:.2f}" for v in measured["trainer"]["progress_bar_ratio_per_round"])
            lines.append(
                f"- {backend}-dp with the progress bar, {_against(bar, target)}x of no callback < {target:.2f}x"
                f" (per round: {rounds}); plain `model.fit` measured {keras_bar:.2f}x."
            )
    return lines


def _callback_shortfall(backend: str, measured: dict[str, Any]) -> str:
    """Where the extra time per step goes with a batch callback, from the timers in the rounds."""
    ratio, per_step = measured["trainer"]["median_ratio"], measured["trainer"]["per_step"]
    without, with_callback = per_step["without"], per_step["with"]
    extra = with_callback["step_ms"] - without["step_ms"]
    parts = {
        "trainer_logs_ms": f"producing each step's logs ({TRAINER_LOGS[backend]})",
        "train_step_ms": "torch_dp's `train_step` (the metric states and rank 0's decisions ride on its all-reduce)",
        "callbacks_ms": "the callbacks' batch-end calls (without a batch callback Keras hands each to a thread)",
    }
    differences = {part: with_callback[part] - without[part] for part in parts if part in with_callback}
    named = [f"{parts[part]}, {difference:+.2f} ms" for part, difference in differences.items()]
    rest = extra - sum(differences.values())
    return (
        f"- {backend}-dp with a logs-only batch callback, {ratio:.2f}x < {BATCH_CALLBACK_RATIO}x: a step took"
        f" {with_callback['step_ms']:.2f} ms with it against {without['step_ms']:.2f} ms without (medians over"
        f" the rounds), {extra:+.2f} ms. Of that: {'; '.join(named)}; the rest, {rest:+.2f} ms,"
        f" {REST_OF_LOOP[backend]}."
        f" Plain `model.fit` measured {measured['keras']['median_ratio']:.2f}x with the same callback."
        + _bare_step_floor(measured["trainer"].get("bare_step"))
    )


def _bare_step_floor(bare: dict[str, Any] | None) -> str:
    if bare is None:
        return ""
    return (
        f" The same model's bare jitted step on the same devices (`jax_bare_step`: no trainer, no metrics) ran"
        f" at {bare['median_ratio']:.2f}x when the host waited for each step's loss before the next, against"
        " back to back: a callback gets every step's logs as Python numbers, so that wait is the floor under"
        " any loop that serves one."
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--results", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--output", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args()
    torch_results = json.loads((args.results / "torch.json").read_text())
    jax_results = json.loads((args.results / "jax.json").read_text())
    steps = json.loads((args.results / "torch_steps.json").read_text())
    interactive = json.loads((args.results / "interactive.json").read_text())
    plot_throughput(
        {"torch": torch_medians(torch_results), "jax": jax_results["median_samples_per_second"]},
        args.results / "throughput.png",
    )
    plot_scaling(
        {"torch": torch_results["weak_scaling"], "jax": jax_results["weak_scaling"]}, args.results / "scaling.png"
    )
    # Image links are relative to the page, which sits next to the results folder.
    images = Path(os.path.relpath(args.results.resolve(), args.output.resolve().parent))
    host, versions = jax_results["host"], {**torch_results["versions"], **jax_results["versions"]}
    first_step = torch_results["median_first_step_s"]
    quick = torch_results["setup"]["quick"] or jax_results["quick"] or any(interactive[b]["quick"] for b in BACKENDS)
    lines = [
        "# Benchmarks",
        "",
        *(["**A `--quick` smoke run: these numbers are not measurements.**", ""] if quick else []),
        "Written by `nox -s bench` (`benchmarks/bench_torch.py`, `benchmarks/bench_jax.py`,",
        "`benchmarks/bench_interactive.py`, then this page from their JSON by `benchmarks/report.py`).",
        "Except for the interactive calls (their own section), the model is the Keras guides' MNIST convnet",
        "(`benchmarks/guide_convnet.py`) on synthetic data of MNIST's shape, global batch 128, 2 replicas on",
        "CPU (torch: 2 processes x 1 thread; jax: 2 host devices). Runs are interleaved (in reverse order every"
        " other round), the first epoch",
        f"of each run is a warm-up, and each ratio is the median of the per-round ratios over"
        f" {torch_results['setup']['rounds']} (torch) and {jax_results['rounds']} (jax) rounds.",
        "",
        *summary_table(torch_results, jax_results),
        "",
        "Memory rows: how much the peak memory grows when the dataset grows to the large array, as a",
        f"multiple of its size; it counts as one copy below {MEMORY_TARGET}x (nearer one copy than two), and",
        "anything beyond one copy is stated under Shortfalls.",
        "",
        "![median samples/s](benchmarks/throughput.png)",
        "",
        *scaling_section(torch_results, jax_results),
        "",
        *kept_heap_section(jax_results),
        *keras_distribution_section(jax_results),
        "",
        "## Time to the first step",
        "",
        f"- torch-dp: {first_step['torch_dp']:.1f} s from the `fit` call to the start of training, against"
        f" {first_step['ddp_loop']:.1f} s",
        "  for the guide's DDP loop: both spawn 2 processes that import torch and Keras;",
        f"  `model.fit` in the calling process starts after {first_step['keras_fit']:.2f} s.",
        f"- jax-dp: {jax_results['median_first_step_s']['jax_dp']:.1f} s from the `fit` call until its first step is"
        " compiled and dispatched",
        "  (one process, no start-up beyond jax's compilation).",
        "- Both are a new Trainer's first `fit`: a Trainer's later calls are in the next section.",
        "",
        *interactive_section(interactive),
        "",
        *memory_section(torch_results, jax_results),
        "",
        "## Machine, versions, command",
        "",
        *machine_lines(torch_results, jax_results),
        f"- {host['cpu_count']} CPU cores ({host['machine']}), Python {host['python']}; torch {versions['torch']},"
        f" jax {versions['jax']}, Keras {versions['keras']},",
        f"  torch-dp {versions['torch_dp']}, jax-dp {versions['jax_dp']}.",
        "- `nox -s bench` (about 23 minutes on 2 idle cores), or `python benchmarks/bench_torch.py --output",
        "  docs/benchmarks/torch.json`, `python benchmarks/bench_jax.py --output docs/benchmarks/jax.json`,",
        "  `python benchmarks/bench_interactive.py --output docs/benchmarks/interactive.json` (about 3 minutes),",
        "  `python benchmarks/report.py`; `nox -s bench -- --quick` is a smoke run of a few minutes.",
        "",
        "## Shortfalls, stated",
        "",
        *throughput_shortfalls(torch_results, jax_results, steps),
        *shortfalls(torch_results, jax_results, steps),
        *interactive_shortfalls(interactive),
    ]
    text = "\n".join(lines) + "\n"
    # sections that their own scripts write (the GPU check on another machine): kept as they are
    previous = args.output.read_text() if args.output.exists() else ""
    for heading in KEPT_SECTIONS:
        kept = page_sections.section_of(previous, heading)
        if kept is not None:
            text = page_sections.with_section(text, heading, kept)
    kept = gpu_check.section_of(previous)
    text = gpu_check.with_section(text, kept or gpu_check.NOT_RUN.format(heading=gpu_check.SECTION_HEADING))
    args.output.write_text(text.replace("](benchmarks/", f"]({images.as_posix()}/"))
    print(f"wrote {args.output}, {args.results / 'throughput.png'} and {args.results / 'scaling.png'}")


def _usable_cores(torch_results: dict[str, Any], jax_results: dict[str, Any]) -> list[float]:
    return [
        *torch_results["usable_cores"],
        *jax_results["usable_cores"],
        *jax_results["weak_scaling"]["usable_cores"],
    ]


def machine_lines(torch_results: dict[str, Any], jax_results: dict[str, Any]) -> list[str]:
    """How much CPU the runs had, from a 1-second check of one busy thread per core each round."""
    cores, total = _usable_cores(torch_results, jax_results), jax_results["host"]["cpu_count"]
    lines = [
        f"- CPU the benchmark had, checked before each round (one busy thread per core for 1 s):"
        f" median {statistics.median(cores):.2f} of {total} cores, lowest {min(cores):.2f}.",
    ]
    if statistics.median(cores) < 0.9 * total:
        lines.append(
            "  **Other jobs held part of the machine during these runs: the scaling efficiencies and"
            " ratios below full use of the cores are not representative; rerun on a quiet machine.**"
        )
    return lines


def _spread(ours: list[float], theirs: list[float]) -> str:
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return f"{min(ratios):.2f}x to {max(ratios):.2f}x"


def throughput_shortfalls(
    torch_results: dict[str, Any], jax_results: dict[str, Any], steps: dict[str, Any]
) -> list[str]:
    """A line for each throughput target not met, with the measurement that explains it."""
    lines = []
    torch_ratio = torch_results["median_ratio_vs_ddp_loop"]
    torch_target = THROUGHPUT_TARGETS[("torch", "ddp_loop")]
    if torch_ratio < torch_target:
        same_work = torch_results["median_ratio_vs_ddp_loop_keras_work"]
        keras_work = torch_results["median_ratio_of_keras_work_in_ddp_loop"]
        shares = {name: statistics.mean(values) for name, values in steps["share_of_step"].items()}
        lines.append(
            f"- torch-dp vs the guide's DDP loop, {torch_ratio:.2f}x < {torch_target}x: the guide's loop does less"
            " work per step. Its `model(inputs)` runs the Keras layers in inference mode, so Dropout is off (a"
            " BatchNormalization layer would not learn its statistics either), and it uses torch's loss and"
            " optimizer and computes no metric. The same DDP loop doing torch-dp's work (training-mode forward,"
            f" the compiled Keras loss, optimizer, loss tracker and accuracy metric) runs at {keras_work:.2f}x the"
            f" guide's, and torch-dp runs at {same_work:.2f}x that loop: the gap is that work, not how torch-dp"
            " distributes it. In a torch-dp step (`benchmarks/torch_step_breakdown.py`, 2 replicas under"
            f" torchrun) the Keras optimizer takes {shares['keras_optimizer_s']:.1%}, the loss's forward pass"
            f" {shares['keras_loss_s']:.1%} and the metric {shares['keras_metrics_s']:.1%}; the gradient"
            f" all-reduce, waiting for the other replica included, {shares['all_reduce_s']:.1%}. DDP cannot"
            " overlap its all-reduce with the backward pass here either: the model's 35k parameters fill"
            " less than its first 1 MiB bucket."
        )
    per_round = jax_results["samples_per_second"]
    for other, label in (("guide_loop", "the guide's loop"), ("keras_data_parallel", "`keras.distribution`")):
        ratio, target = jax_results["median_ratio_jax_dp_over"][other], THROUGHPUT_TARGETS[("jax", other)]
        if ratio >= target:
            continue
        spread = _spread(per_round["jax_dp"], per_round[other])
        if other == "guide_loop":
            loss_only = jax_results["median_ratio_jax_dp_loss_only_over_guide_loop"]
            cause = (
                "both compile the same model, loss and Adam update into one jitted XLA step per batch, and"
                " jax-dp's step adds only the accuracy metric (a few reductions over the 64 x 10 predictions"
                f" of each device); without the metric jax-dp measured {loss_only:.2f}x in the same rounds."
                " No cost beyond the round-to-round noise of this machine was found: the result is parity"
            )
        else:
            cause = (
                "both run one jitted XLA step per batch with the same model, loss, metric and optimizer; no"
                " cause beyond the round-to-round noise was found"
            )
        lines.append(f"- jax-dp vs {label}, {ratio:.2f}x < {target}x (per-round ratios {spread}): {cause}.")
    return lines


def shortfalls(torch_results: dict[str, Any], jax_results: dict[str, Any], steps: dict[str, Any]) -> list[str]:
    """A line for each target not met, with what is known of its cause."""
    cores, total = _usable_cores(torch_results, jax_results), jax_results["host"]["cpu_count"]
    lines = []
    for backend, results in (("torch", torch_results), ("jax", jax_results)):
        of_ceiling = results["weak_scaling"]["of_ceiling_per_round"]
        if statistics.median(of_ceiling) < CEILING_TARGET:
            if backend == "torch":
                all_reduce = statistics.mean(steps["share_of_step"]["all_reduce_s"])
                cause = f"the replicas' gradient all-reduce and waiting for each other, {all_reduce:.1%} of a step"
            else:
                cause = (
                    "the 2-device process runs both devices' steps, the cross-device reductions and the Python thread"
                    " that places each batch on the same 2 cores, where each lone process has a core to itself"
                )
                measured = results["weak_scaling"].get("no_communication")
                if measured is not None:
                    cause += (
                        "; a step with no communication at all, on 2 devices of one process, already reaches only"
                        f" {measured['median_one_process_of_ceiling']:.2f} of two lone processes (XLA's CPU runtime"
                        f" itself), and jax-dp runs at {measured['median_jax_dp_of_one_process']:.2f}x that step"
                    )
            if statistics.median(cores) < 0.9 * total:
                cause += f"; and these runs had a median of only {statistics.median(cores):.2f} of {total} cores"
            lines.append(
                f"- {backend}-dp weak scaling at {statistics.median(of_ceiling):.2f} of the machine's ceiling <"
                f" {CEILING_TARGET} (per round: {', '.join(f'{v:.2f}' for v in of_ceiling)}): {cause}."
            )
    for batch, setting, ratio in keras_distribution_ratios(jax_results):
        if batch in KERAS_DISTRIBUTION_TARGET_BATCHES and ratio < KERAS_DISTRIBUTION_TARGET:
            m = jax_results["keras_distribution"]["by_batch_and_setting"][f"{batch}/{setting}"]
            rounds = ", ".join(f"{v:.2f}" for v in m["ratio_per_round"])
            lines.append(
                f"- jax-dp vs `keras.distribution` at global batch {batch}, {SETTING_NAMES[setting]}: {ratio:.2f}x <"
                f" {KERAS_DISTRIBUTION_TARGET:.1f}x (per round: {rounds}); both run one jitted XLA step per batch of"
                " the same program (their compiled steps read the same bytes and FLOPs), so what remains is each"
                " loop's host work per step on cores the devices also compute on."
            )
    dataset = torch_results["memory"]["large"]["dataset_mib"]
    for label, value, source in (
        (
            "torch-dp's 2 workers together",
            torch_results["memory"]["pss_growth_of_workers_as_fraction_of_dataset"],
            "private memory of each worker beyond the shared pages (each worker's RSS grows by"
            f" {torch_results['memory']['rss_growth_per_worker_as_fraction_of_dataset']:.2f}x: it maps the whole"
            " file, as the kernel maps neighbouring pages too, plus its private part)",
        ),
        (
            "jax-dp's process",
            jax_results["memory"]["peak_rss_growth_as_fraction_of_dataset"],
            "memory beyond the caller's array in the process that feeds both devices",
        ),
    ):
        if value > MEMORY_EXCESS_NOTED:
            lines.append(
                f"- {label} grew by {value:.2f}x the dataset, {(value - 1) * dataset:.0f} MiB more than one copy:"
                f" {source}. Likely the batches gathered and converted ahead of the step and the allocators'"
                " slack; not broken down further."
            )
    memory_total = torch_results["memory"]["pss_growth_in_total_as_fraction_of_dataset"]
    lines.append(
        f"- torch-dp memory over all processes grows by {memory_total:.2f}x the dataset: the workers share one"
        " copy, but it is a copy (the `.npy` file they map) next to the caller's own array."
    )
    return lines


if __name__ == "__main__":
    main()
