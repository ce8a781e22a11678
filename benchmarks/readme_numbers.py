"""The numbers the READMEs state, from the benchmark JSON under docs/benchmarks: none is typed by hand.

    python benchmarks/readme_numbers.py [--check] [--results docs/benchmarks]

Each number in a README stands between two markers, ``<!--bench:NAME-->1.07x<!--/bench-->``
(HTML comments: a rendered page shows only the number), and NAME is a row of ``NUMBERS``: which
JSON file, which value, how it is written. Without ``--check`` the READMEs are rewritten from the
JSON (``nox -s bench`` does it after a run); with it nothing is written and the exit status is 1
when a README states another number than its JSON, or a marker names no row
(tests/test_readme_numbers.py runs that check).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
READMES = ("README.md", "packages/core/README.md", "packages/torch_dp/README.md", "packages/jax_dp/README.md")
MARKER = re.compile(r"<!--bench:(?P<name>[a-z0-9_-]+)-->(?P<text>.*?)<!--/bench-->")


def _rounds(results: dict[str, Any], mine: str, theirs: str) -> list[float]:
    """The per-round ratios of two runs' samples/s (the median of which is the headline)."""
    runs = results["runs"]
    return [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(runs[mine], runs[theirs], strict=True)]


def _scaling_line(results: dict[str, Any]) -> str:
    """The line ``profile=True`` printed for the 2-replica report on disk, as ``scaling_summary`` writes it."""
    sys.path.insert(0, str(ROOT / "packages" / "core" / "src"))  # dp_core: numpy and the standard library
    from dp_core import ScalingReport, scaling_summary

    return f"`{scaling_summary(ScalingReport.from_json(results['reports']['2']))}`"


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
    "torch-memory-per-worker": (
        "torch.json",
        lambda r: r["memory"]["pss_growth_per_worker_as_fraction_of_dataset"],
        "{:.2f}x",
    ),
    "syncbn-vs-guide": ("syncbn.json", lambda r: r["median_ratios"]["torch_dp_vs_guide_syncbn"], "{:.2f}x"),
    "scaling-report-line": ("scaling_report.json", _scaling_line, "{}"),
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
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a README disagrees")
    parser.add_argument("--results", type=Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args()
    found = []
    for readme in READMES:
        path = ROOT / readme
        text = path.read_text()
        if args.check:
            found += problems(text, args.results, readme)
        elif (new := rewritten(text, args.results)) != text:
            path.write_text(new)
            print(f"{readme}: numbers rewritten from {args.results}")
    for problem in found:
        print(problem, file=sys.stderr)
    if found:
        print("run python benchmarks/readme_numbers.py to write the JSON's numbers", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
