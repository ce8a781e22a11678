"""The numbers the READMEs and the hand-written docs pages state are the benchmark JSON's
(docs/benchmarks/*.json), none typed by hand, or are labelled as an illustration."""

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "benchmarks"
# a ratio (1.07x), a time (7.3 s, 40 ms) or a size (1,024 MiB): what a benchmark measures
MEASURED = re.compile(r"\b\d[\d,]*(\.\d+)?(x\b| ?(ms|MiB|GiB)\b| s\b)")
# on the docs pages, where settings (a 60 s timeout, 1 MiB buckets) are whole numbers: a ratio with
# decimals, samples/s, milliseconds, a size with decimals, an MFU, a time said to be measured
MEASURED_IN_DOCS = re.compile(
    r"\b\d+\.\d+x\b|\b\d[\d,]*(\.\d+)? samples/s|\b\d+(\.\d+)?(-\d+(\.\d+)?)? ?ms\b"
    r"|\b\d+\.\d+ ?(MiB|GiB|MB|GB)\b|MFU \d|measured:? \d"
)


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
        problem for page in numbers.PAGES for problem in numbers.problems((ROOT / page).read_text(), RESULTS, page)
    ]
    assert found == []
    stated = {
        m["name"]: m["text"] for page in numbers.PAGES for m in numbers.MARKER.finditer((ROOT / page).read_text())
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


def test_the_docs_pages_state_measured_numbers_only_in_a_marker_or_as_an_illustration():
    numbers = _numbers()
    assert "docs/scaling-report.md" in numbers.PAGES and "docs/benchmarks.md" not in numbers.PAGES
    typed, unlabelled = [], []
    for page in (page for page in numbers.PAGES if page.startswith("docs/")):
        text = numbers.MARKER.sub("", (ROOT / page).read_text())
        for region in numbers.ILLUSTRATION.finditer(text):  # the reader sees the word where the region is
            around = text[max(0, region.start() - 200) : region.end()]
            if "illustration" not in numbers.ILLUSTRATION.sub(lambda m: m["text"], around).replace("<!--", "("):
                unlabelled.append(f"{page}: {region['text'][:60]!r}")
        bare = numbers.ILLUSTRATION.sub("", text)
        for line in bare.splitlines():
            typed += [f"{page}: {m[0]!r} in {line.strip()[:80]!r}" for m in MEASURED_IN_DOCS.finditer(line)]
    assert typed == [], (
        "state it as <!--bench:NAME-->...<!--/bench--> (a row in benchmarks/readme_numbers.py), or "
        "wrap it in <!--illustration-->...<!--/illustration--> and say it is one"
    )
    assert unlabelled == [], "an illustration says so where the reader sees it"


def test_pages_that_state_one_measure_state_one_number():
    numbers = _numbers()
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    # the torch memory growth: the README's is the benchmarks page's headline row (it stated another measure)
    row = re.search(r"^\| torch_dp memory growth, 2 workers together.*\| ([\d.]+x) \| met \|$", benchmarks, re.M)
    assert row is not None
    assert numbers.expected("torch-memory-workers", RESULTS) == row[1]
    readme = (ROOT / "packages" / "torch_dp" / "README.md").read_text()
    assert f"<!--bench:torch-memory-workers-->{row[1]}<!--/bench-->" in readme
    # the scaling report's line: the README and the guide state the same measured one
    guide = (ROOT / "docs" / "scaling-report.md").read_text()
    line = numbers.expected("scaling-report-line", RESULTS)
    assert f"<!--bench:scaling-report-line-->{line}<!--/bench-->" in guide
