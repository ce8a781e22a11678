"""The numbers the READMEs state are the benchmark JSON's (docs/benchmarks/*.json), none typed by hand."""

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "benchmarks"
# a ratio (1.07x), a time (7.3 s, 40 ms) or a size (1,024 MiB): what a benchmark measures
MEASURED = re.compile(r"\b\d[\d,]*(\.\d+)?(x\b| ?(ms|MiB|GiB)\b| s\b)")


def _numbers():
    spec = importlib.util.spec_from_file_location("readme_numbers", ROOT / "benchmarks" / "readme_numbers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_number_a_readme_states_is_its_json_value():
    numbers = _numbers()
    found = [
        problem
        for readme in numbers.READMES
        for problem in numbers.problems((ROOT / readme).read_text(), RESULTS, readme)
    ]
    assert found == []
    stated = {
        m["name"]: m["text"] for readme in numbers.READMES for m in numbers.MARKER.finditer((ROOT / readme).read_text())
    }
    # the numbers docs/benchmarks.md states too
    assert stated["torch-vs-ddp-loop"] == "0.97x" and stated["torch-vs-keras-fit"] == "1.23x"
    assert sorted(stated) == sorted(numbers.NUMBERS)  # every row is stated somewhere


def test_no_readme_states_a_measured_number_outside_a_marker():
    numbers = _numbers()
    typed = []
    for readme in numbers.READMES:
        # README's Development section times the nox sessions (tests/test_noxfile.py keeps it)
        text = (ROOT / readme).read_text().split("\n## Development\n")[0]
        for number, line in enumerate(text.splitlines(), 1):
            bare = numbers.MARKER.sub("", line)
            typed += [f"{readme}:{number}: {m[0]!r}" for m in MEASURED.finditer(bare)]
    assert typed == [], "state it as <!--bench:NAME-->...<!--/bench--> with a row in benchmarks/readme_numbers.py"


def test_a_number_that_differs_from_the_json_is_named_with_both_values():
    numbers = _numbers()
    text = "median **<!--bench:torch-vs-ddp-loop-->1.09x<!--/bench-->**, <!--bench:made-up-->3.0x<!--/bench-->"
    assert numbers.problems(text, RESULTS, "README.md") == [
        "README.md: torch-vs-ddp-loop says '1.09x', docs/benchmarks/torch.json gives '0.97x'",
        "README.md: <!--bench:made-up--> names no row of benchmarks/readme_numbers.py NUMBERS",
    ]
    assert numbers.rewritten(text, RESULTS).startswith("median **<!--bench:torch-vs-ddp-loop-->0.97x<!--/bench-->**")


def test_the_readme_line_of_the_scaling_report_is_what_the_report_on_disk_prints():
    numbers = _numbers()
    line = numbers.expected("scaling-report-line", RESULTS)
    assert line.startswith("`2 replicas: 1.92x one replica (measured), all-reduce 15% of a step")
