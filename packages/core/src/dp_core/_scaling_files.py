"""The scaling report's folder: ``scaling_report.json``, one entry per replica count, and
``scaling_report.png`` where matplotlib is installed (``pip install dp-core[report]``; imported
when a plot is drawn). A fit's report is added with ``write_scaling_report``, which also returns the
one line the trainer prints (``publish_scaling_report`` prints it); ``read_scaling_reports`` reads a folder back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from dp_core._scaling import MEASURED, SCALING_PHASES, ScalingReport, scaling_summary, with_speedup
from dp_core._scaling_checks import oversubscription

DEFAULT_FOLDER = "scaling-report"
JSON_NAME = "scaling_report.json"
PNG_NAME = "scaling_report.png"
FORMAT = "dp-core scaling report"
FORMAT_VERSION = 1


def scaling_report_folder(profile: bool | str | os.PathLike[str]) -> Path | None:
    """Where ``Trainer(profile=...)`` writes: ``True`` is ``./scaling-report``, a path is itself,
    ``False`` (or None) is no report."""
    if profile is None or profile is False:
        return None
    if profile is True:
        return Path.cwd() / DEFAULT_FOLDER
    if isinstance(profile, str | os.PathLike):
        return Path(profile).absolute()  # a replica started elsewhere writes to the same folder
    raise TypeError(
        f"profile must be True, False or a folder path, got {profile!r} ({type(profile).__name__}); "
        f"e.g. Trainer(profile=True) writes into ./{DEFAULT_FOLDER}, Trainer(profile='runs/report') there."
    )


def read_scaling_reports(folder: str | os.PathLike[str]) -> dict[int, ScalingReport]:
    """The reports in ``folder``'s ``scaling_report.json`` by replica count (empty when none)."""
    path = Path(folder) / JSON_NAME
    if not path.exists():
        return {}
    document = json.loads(path.read_text())
    if document.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not a scaling report (its 'format' is {document.get('format')!r}, expected {FORMAT!r}); "
            "pass Trainer(profile=...) another folder, or remove the file."
        )
    return {int(count): ScalingReport.from_json(entry) for count, entry in document["reports"].items()}


def write_scaling_report(report: ScalingReport, folder: str | os.PathLike[str]) -> tuple[ScalingReport, str]:
    """Add ``report`` to ``folder`` (replacing its replica count's entry; entries of another model or
    global batch are dropped: a folder describes one run), write the JSON and the PNG, and return the
    report with its speedup and the one-line summary. Without matplotlib the line says so."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    reports = {count: old for count, old in read_scaling_reports(folder).items() if old.same_run_as(report)}
    report = with_speedup(report, reports.get(1))
    reports[report.num_replicas] = report
    document = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "phases": list(SCALING_PHASES),
        "reports": {str(count): reports[count].to_json() for count in sorted(reports)},
    }
    temporary = folder / (JSON_NAME + ".tmp")
    temporary.write_text(json.dumps(document, indent=2) + "\n")
    os.replace(temporary, folder / JSON_NAME)
    line = scaling_summary(report)
    try:
        plot_scaling_reports(list(reports.values()), folder / PNG_NAME)
    except ImportError:
        line += f" (no plot: pip install 'dp-core[report]' for {PNG_NAME}; the JSON is written)"
    return report, line


def publish_scaling_report(
    report: ScalingReport, folder: str | os.PathLike[str], *, cpu_replicas: int | None = None, threads: int = 1
) -> ScalingReport:
    """A profiled fit's end on the process that reports: ``report`` added to ``folder``
    (``write_scaling_report``) and its line printed, after a warning when ``cpu_replicas`` (this
    host's replicas, where they run on its CPU; None elsewhere) of ``threads`` each outnumber its
    cores. Returns the report with its speedup."""
    report, line = write_scaling_report(report, folder)
    if cpu_replicas is not None and (crowded := oversubscription(cpu_replicas, threads=threads)):
        print(f"scaling report: {crowded}", flush=True)
    print(line, flush=True)
    return report


def plot_scaling_reports(reports: Sequence[ScalingReport], path: str | os.PathLike[str]) -> None:
    """Stacked bars of each replica count's step time by phase; next to them samples/s against
    replica count when there are several. Raises ImportError without matplotlib."""
    import matplotlib  # pyright: ignore[reportMissingImports]  (optional: dp-core[report])

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt  # pyright: ignore[reportMissingImports]

    reports = sorted(reports, key=lambda r: r.num_replicas)
    several = len(reports) > 1
    figure, axes = plt.subplots(1, 2 if several else 1, figsize=(10 if several else 5.5, 4), squeeze=False)
    bars = axes[0][0]
    labels = [str(r.num_replicas) for r in reports]
    bottoms = [0.0] * len(reports)
    for phase in SCALING_PHASES:
        heights = [r.phases[phase].seconds * 1000 for r in reports]
        estimated = any(r.phases[phase].how != MEASURED for r in reports)
        name = phase.replace("_", " ") + (" (estimated)" if estimated else "")
        bars.bar(labels, heights, bottom=bottoms, label=name)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    bars.set_xlabel("replicas")
    bars.set_ylabel("ms per step")
    bars.set_title(f"{reports[-1].backend}: {reports[-1].model}, global batch {reports[-1].global_batch_size}")
    bars.legend(fontsize=8)
    if several:
        rate = axes[0][1]
        counts = [r.num_replicas for r in reports]
        rate.plot(counts, [r.samples_per_second for r in reports], marker="o", label="measured")
        if reports[0].num_replicas == 1:
            ideal = [reports[0].samples_per_second * n for n in counts]
            rate.plot(counts, ideal, linestyle="--", color="grey", label="linear")
        rate.set_xticks(counts)
        rate.set_xlabel("replicas")
        rate.set_ylabel("samples/s")
        rate.set_title("throughput")
        rate.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
