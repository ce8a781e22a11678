"""The numbers the READMEs and the hand-written docs pages state, from the benchmark JSON under
docs/benchmarks: none is typed by hand.

    python benchmarks/readme_numbers.py [--check] [--results docs/benchmarks]

Each measured number on those pages (``PAGES``) stands between two markers,
``<!--bench:NAME-->1.07x<!--/bench-->`` (HTML comments: a rendered page shows only the number),
and NAME is a row of ``NUMBERS``: which JSON file, which value, how it is written. A number that
is no measurement of this repository's (a GPU's line as an example, one run by hand) stands
between ``<!--illustration-->`` and ``<!--/illustration-->`` and says "illustration" where the
reader sees it. Without ``--check`` the pages are rewritten from the JSON (``nox -s bench`` does
it after a run); with it nothing is written and the exit status is 1 when a page states another
number than its JSON, or a marker names no row (tests/test_readme_numbers.py runs that check,
and finds measured-looking numbers outside both markers). The pages a benchmark or a test writes
whole (docs/benchmarks.md, docs/reliability.md, docs/keras-compatibility.md) are not among them.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
READMES = ("README.md", "packages/core/README.md", "packages/torch_dp/README.md", "packages/jax_dp/README.md")
WRITTEN_WHOLE = ("benchmarks.md", "reliability.md", "keras-compatibility.md")  # by their scripts, from results
PAGES = READMES + tuple(
    f"docs/{page.name}" for page in sorted((ROOT / "docs").glob("*.md")) if page.name not in WRITTEN_WHOLE
)
MARKER = re.compile(r"<!--bench:(?P<name>[a-z0-9_-]+)-->(?P<text>.*?)<!--/bench-->")
ILLUSTRATION = re.compile(r"<!--illustration-->(?P<text>.*?)<!--/illustration-->", re.DOTALL)


def _rounds(results: dict[str, Any], mine: str, theirs: str) -> list[float]:
    """The per-round ratios of two runs' samples/s (the median of which is the headline)."""
    runs = results["runs"]
    return [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(runs[mine], runs[theirs], strict=True)]


def _scaling_line(results: dict[str, Any]) -> str:
    """The line ``profile=True`` printed for the 2-replica report on disk, as ``scaling_summary`` writes it."""
    sys.path.insert(0, str(ROOT / "packages" / "core" / "src"))  # dp_core: numpy and the standard library
    from dp_core import ScalingReport, scaling_summary

    return f"`{scaling_summary(ScalingReport.from_json(results['reports']['2']))}`"


def _model_parallel_rows() -> dict[str, tuple[str, Callable[[dict[str, Any]], Any], str]]:
    """docs/model-parallel.md's table: each mesh's bytes per device, and its total against data parallel."""
    meshes = {"dp": "(4,) data parallel", "2x2": "(2, 2) batch x model", "mp": "(1, 4) model parallel"}
    columns = {"parameters": "parameter_bytes", "optimizer": "optimizer_bytes", "total": "total_bytes"}
    rows: dict[str, tuple[str, Callable[[dict[str, Any]], Any], str]] = {}
    for short, mesh in meshes.items():
        for column, key in columns.items():
            rows[f"model-parallel-{short}-{column}"] = (
                "model_parallel.json",
                lambda r, mesh=mesh, key=key: r["meshes"][mesh][key] / 2**20,
                "{:.2f} MiB",
            )
        rows[f"model-parallel-{short}-vs-dp"] = (
            "model_parallel.json",
            lambda r, mesh=mesh: r["meshes"][mesh]["total_bytes"] / r["meshes"][meshes["dp"]]["total_bytes"],
            "{:.2f}x",
        )
    return rows


def _scope_memory_rows() -> dict[str, tuple[str, Callable[[dict[str, Any]], Any], str]]:
    """docs/sharding.md's GPT-2 in ``scope()``: the state's sizes, each moment's most held, XLA's accounting (MB)."""
    file = "scope_memory_jax.json"

    def quarter(r: dict[str, Any]) -> float:  # of the weights and AdamW's slots: what a device holds, sharded
        return (r["scoped"]["weights_bytes"] + r["scoped"]["slots_bytes"]) / 4

    megabytes: dict[str, Callable[[dict[str, Any]], float]] = {
        "weights": lambda r: r["scoped"]["weights_bytes"],
        "slots": lambda r: r["scoped"]["slots_bytes"],
        "quarter": quarter,
        "above-quarter": lambda r: r["most_held_bytes"] - quarter(r),
        "largest-layer": lambda r: r["scoped"]["largest_layer_bytes"],
        "bound": lambda r: r["bound_bytes"],
        "arguments": lambda r: r["scoped"]["memory_analysis"]["argument_bytes"],
        "temporaries": lambda r: r["scoped"]["memory_analysis"]["temp_bytes"],
        "peak": lambda r: r["scoped"]["memory_analysis"]["peak_bytes"],
    }
    rows = {f"scope-{name}": (file, lambda r, f=f: f(r) / 1e6, "{:.1f} MB") for name, f in megabytes.items()}
    rows["scope-most-held-bytes"] = (file, lambda r: r["most_held_bytes"], "{:,}")
    rows["scope-quarter-bytes"] = (file, lambda r: int(quarter(r)), "{:,}")
    rows["scope-vs-model-fit"] = (file, lambda r: r["scoped_vs_reference"]["max_abs"], "{:.1e}")
    rows["scope-unsharded-vs-model-fit"] = (file, lambda r: r["unsharded_vs_reference"]["max_abs"], "{:.1e}")
    moments = (
        "construction",
        "after loading",
        "optimizer built",
        "step 1",
        "step 10",
        "after fit and checkpoints",
        "after saving",
    )
    for moment in moments:
        rows[f"scope-held-{moment.replace(' ', '-')}"] = (
            file,
            lambda r, moment=moment: max(r["scoped"]["samples"][moment].values()) / 1e6,
            "{:.1f}",
        )
    return rows


TORCH_SCOPE_PHASES = (  # scope_memory_torch.py's phases, as the page names them
    "construction and loading",
    "epoch 1 and its checkpoints",
    "built again in a new job, resumed: epoch 2",
    "saving",
)


def _scope_memory_torch_rows() -> dict[str, tuple[str, Callable[[dict[str, Any]], Any], str]]:
    """docs/sharding.md's torch-dp scope numbers: the state, the cap, each replica's peak in each phase
    and the highest cgroup count."""
    file = "scope_memory_torch.json"
    rows: dict[str, tuple[str, Callable[[dict[str, Any]], Any], str]] = {
        "scope-torch-parameters": (file, lambda r: r["preset"]["parameters"], "{:,}"),
        "scope-torch-state": (file, lambda r: r["scoped"]["state_bytes"] / 1e6, "{:.1f} MB"),
        "scope-torch-quarter": (file, lambda r: r["scoped"]["state_bytes"] / 4e6, "{:.1f} MB"),
        "scope-torch-cap": (file, lambda r: r["scoped"]["cap_bytes"] / 1e6, "{:.1f} MB"),
        "scope-torch-vs-model-fit": (file, lambda r: r["scoped_vs_reference"]["max_abs"], "{:.1e}"),
    }
    rows["scope-torch-unsharded-vs-model-fit"] = (file, lambda r: r["unsharded_vs_reference"]["max_abs"], "{:.1e}")
    for index, name in enumerate(TORCH_SCOPE_PHASES):
        rows[f"scope-torch-cgroup-{index + 1}"] = (
            file,
            lambda r, name=name: max(r["scoped"]["peaks"][name]["cgroup"]) / 1e6,
            "{:.0f}",
        )
        for rank in range(4):  # each replica's own peak
            rows[f"scope-torch-anonymous-{index + 1}-{rank}"] = (
                file,
                lambda r, name=name, rank=rank: r["scoped"]["peaks"][name]["anonymous"][rank] / 1e6,
                "{:.0f}",
            )
    return rows


def _prefetch_rows() -> dict[str, tuple[str, Callable[[dict[str, Any]], Any], str]]:
    """docs/sharding.md's prefetch numbers: per replica count, the wait prefetch hid and "full"'s speed
    over unsharded data parallel's with and without it (prefetch_torch.py)."""

    def run(results: dict[str, Any], replicas: int, prefetch: bool) -> dict[str, Any]:
        return next(r for r in results["runs"] if r["replicas"] == replicas and r["prefetch"] == prefetch)

    def ratio(results: dict[str, Any], replicas: int, prefetch: bool) -> float:
        speed = run(results, replicas, prefetch)["samples_per_second"]
        return speed["full"] / speed["None"]

    def hidden(results: dict[str, Any], replicas: int) -> float:
        waits = [run(results, replicas, p)["weights_gather_seconds"] for p in (True, False)]
        return 1.0 - waits[0] / waits[1]

    file, rows = "prefetch_torch.json", {}
    for n in (2, 4):
        rows[f"prefetch-torch-hidden-{n}"] = (file, lambda r, n=n: hidden(r, n), "{:.0%}")
        for prefetch, name in ((False, "off"), (True, "on")):
            rows[f"prefetch-torch-ratio-{name}-{n}"] = (file, lambda r, n=n, p=prefetch: ratio(r, n, p), "{:.2f}x")
    return rows


def _malloc_rows() -> dict[str, tuple[str, Callable[[dict[str, Any]], Any], str]]:
    """docs/troubleshooting.md's glibc numbers: each backend's convnet at N=1 under glibc's defaults and
    with the settings every other run held (bench_steps_per_execution.py), both sides' runs together."""

    def pooled(part: dict[str, Any], key: str) -> list[float]:
        values = part["rounds_ms_per_step"] if key == "ms" else part["faults_per_step"]
        return [*values["keras"], *values["trainer"]]

    def defaults(r: dict[str, Any], backend: str) -> dict[str, Any]:
        return r[backend]["glibc_defaults"]

    def held(r: dict[str, Any], backend: str) -> dict[str, Any]:
        return r[backend]["results"][defaults(r, backend)["setting"]]

    file, rows = "steps_per_execution.json", {}
    for b in ("torch", "jax"):
        rows |= {
            f"malloc-{b}-defaults-faults": (
                file,
                lambda r, b=b: statistics.median(pooled(defaults(r, b), "faults")),
                "{:,.0f}",
            ),
            f"malloc-{b}-defaults-ms": (
                file,
                lambda r, b=b: statistics.median(pooled(defaults(r, b), "ms")),
                "{:.1f} ms",
            ),
            f"malloc-{b}-held-faults": (file, lambda r, b=b: max(pooled(held(r, b), "faults")), "{:.1f}"),
            f"malloc-{b}-held-ms": (file, lambda r, b=b: statistics.median(pooled(held(r, b), "ms")), "{:.1f} ms"),
        }
    return rows


# name: (JSON file under docs/benchmarks, the value, how it is written)
NUMBERS: dict[str, tuple[str, Callable[[dict[str, Any]], Any], str]] = {
    "torch-vs-ddp-loop": ("torch.json", lambda r: r["median_ratio_vs_ddp_loop"], "{:.2f}x"),
    "torch-vs-ddp-loop-rounds": (
        "torch.json",
        lambda r: ", ".join(f"{ratio:.2f}x" for ratio in _rounds(r, "torch_dp", "ddp_loop")),
        "{}",
    ),
    "torch-vs-ddp-loop-keras-work": ("torch.json", lambda r: r["median_ratio_vs_ddp_loop_keras_work"], "{:.2f}x"),
    "torch-vs-keras-fit": ("torch.json", lambda r: r["median_ratio_vs_keras_fit"], "{:.2f}x"),
    "torch-first-step": ("torch.json", lambda r: r["median_first_step_s"]["torch_dp"], "{:.1f} s"),
    "torch-ddp-first-step": ("torch.json", lambda r: r["median_first_step_s"]["ddp_loop"], "{:.1f} s"),
    "torch-memory-dataset": ("torch.json", lambda r: r["memory"]["large"]["dataset_mib"], "{:,.0f} MiB"),
    # the workers together, as docs/benchmarks.md's memory row states it
    "torch-memory-workers": (
        "torch.json",
        lambda r: r["memory"]["pss_growth_of_workers_as_fraction_of_dataset"],
        "{:.2f}x",
    ),
    "syncbn-vs-guide": ("syncbn.json", lambda r: r["median_ratios"]["torch_dp_vs_guide_syncbn"], "{:.2f}x"),
    "scaling-report-line": ("scaling_report.json", _scaling_line, "{}"),
    "keras-dp-torch-speed": (
        "keras_distribution_torch.json",
        lambda r: r["speed"]["median_samples_per_s"]["keras_data_parallel"],
        "{:.0f} samples/s",
    ),
    "keras-dp-torch-speed-torch-dp": (
        "keras_distribution_torch.json",
        lambda r: r["speed"]["median_samples_per_s"]["torch_dp"],
        "{:.0f} samples/s",
    ),
    "keras-dp-torch-speed-ratio": ("keras_distribution_torch.json", lambda r: r["speed"]["median_ratio"], "{:.2f}x"),
    **_model_parallel_rows(),
    **_scope_memory_rows(),
    **_scope_memory_torch_rows(),
    **_prefetch_rows(),
    **_malloc_rows(),
}


def expected(name: str, results: Path) -> str:
    """What the README must say at marker ``name``, from the JSON in ``results``."""
    file, value, form = NUMBERS[name]
    return form.format(value(json.loads((results / file).read_text())))


def problems(text: str, results: Path, where: str) -> list[str]:
    """Each marker of ``text`` that names no row or states another number than the JSON."""
    found = []
    for match in MARKER.finditer(text):
        name, stated = match["name"], match["text"]
        if name not in NUMBERS:
            found.append(f"{where}: <!--bench:{name}--> names no row of benchmarks/readme_numbers.py NUMBERS")
        elif stated != (wanted := expected(name, results)):
            file = NUMBERS[name][0]
            found.append(f"{where}: {name} says {stated!r}, docs/benchmarks/{file} gives {wanted!r}")
    return found


def rewritten(text: str, results: Path) -> str:
    """``text`` with every known marker's number taken from the JSON."""

    def number(match: re.Match[str]) -> str:
        if match["name"] not in NUMBERS:
            return match[0]
        return f"<!--bench:{match['name']}-->{expected(match['name'], results)}<!--/bench-->"

    return MARKER.sub(number, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page disagrees")
    parser.add_argument("--results", type=Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args()
    found = []
    for page in PAGES:
        path = ROOT / page
        text = path.read_text()
        if args.check:
            found += problems(text, args.results, page)
        elif (new := rewritten(text, args.results)) != text:
            path.write_text(new)
            print(f"{page}: numbers rewritten from {args.results}")
    for problem in found:
        print(problem, file=sys.stderr)
    if found:
        print("run python benchmarks/readme_numbers.py to write the JSON's numbers", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
