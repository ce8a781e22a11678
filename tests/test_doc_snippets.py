"""Every Python block in README.md, the packages' READMEs and docs/, run as pasted, or marked a fragment.

A block runs on its own, in a fresh ``python snippet.py``: it builds its own model and its own tiny
data, so a reader who pastes it sees it work. A block that shows a piece of a larger script (the
reader's model, a cluster, a file of theirs) says so: the line before its fence is
``<!-- fragment -->`` and its first line is a comment naming what the reader brings. This test skips
those by that marker, and fails on any other block that does not run, so a new block runs unless
its page says why not (docs/troubleshooting.md, "Code on these pages", tells readers the rule).

The backend is the one the block chooses (``KERAS_BACKEND`` set in the block, or ``torch_dp`` /
``jax_dp`` imported); a block that names neither runs on jax. ``XLA_FLAGS`` is not set, as in a
reader's fresh shell: on a CPU jax sees one device, so a block that needs several sets the flag
itself before jax is imported. About 1.5 minutes on 2 cores, in ``conformance(keras='newest')``,
which installs both backends.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(f"packages/{p.parent.name}/README.md" for p in ROOT.glob("packages/*/README.md"))]
PAGES += sorted(f"docs/{p.name}" for p in ROOT.glob("docs/*.md"))
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python\n(?P<code>.*?)^(?P=indent)```", re.DOTALL | re.MULTILINE)
FRAGMENT = "<!-- fragment -->"
# What a block prints, where its output is the point: checked on its last line.
LAST_LINE = {"packages/torch_dp/README.md:1": r"\[\d+\.\d+, \d+\.\d+\] \(1000, 10\)"}
# Blocks written for either backend (KERAS_BACKEND's default set in the block, the reader's shell choosing):
# run as pasted, and again with KERAS_BACKEND=torch.
EITHER_BACKEND = {"docs/model-parallel.md:1"}


class Block(NamedTuple):
    page: str
    number: int  # 1 for a page's first python block
    line: int  # of its opening fence
    code: str
    fragment: bool

    @property
    def name(self) -> str:
        return f"{self.page}:{self.number}"


def page_blocks(page: str) -> list[Block]:
    text = (ROOT / page).read_text()
    found = []
    for number, match in enumerate(FENCE.finditer(text), start=1):
        before = text[: match.start()].rstrip().splitlines()
        indent = match.group("indent")
        code = "".join(line.removeprefix(indent) for line in match.group("code").splitlines(keepends=True))
        fragment = bool(before) and before[-1].strip() == FRAGMENT
        found.append(Block(page, number, len(before) + 1, code, fragment))
    return found


BLOCKS = [block for page in PAGES for block in page_blocks(page)]
RUN = [block for block in BLOCKS if not block.fragment]


def backend(code: str) -> str | None:
    """The Keras backend a block runs on; None where the block sets ``KERAS_BACKEND`` itself."""
    if "KERAS_BACKEND" in code:
        return None
    return "torch" if re.search(r"\btorch(_dp)?\b", code) else "jax"


def test_the_pages_hold_blocks_of_both_kinds():
    # the scan reaches every page kind: a wrong pattern would find none, or no fragment
    assert {block.page for block in RUN} >= {"README.md", "packages/jax_dp/README.md", "docs/model-parallel.md"}
    assert len(RUN) >= 10 and len(BLOCKS) - len(RUN) >= 10


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.fragment], ids=lambda b: b.name)
def test_a_fragment_says_what_the_reader_brings(block):
    first = block.code.lstrip().splitlines()[0]
    assert first.startswith("# "), (
        f"{block.name} (line {block.line}): a fragment starts with a comment naming what is yours"
    )


def test_backend_follows_what_the_block_imports():
    assert backend('import os; os.environ["KERAS_BACKEND"] = "torch"') is None
    assert backend("import torch_dp\ntrainer = torch_dp.Trainer()") == "torch"
    assert backend("import jax_dp") == "jax"
    assert backend("import dp_core") == "jax"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", RUN, ids=lambda b: b.name)
def test_the_block_runs_as_pasted(block, tmp_path):
    _run_as_pasted(block, tmp_path, shell_backend=None)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", [b for b in RUN if b.name in EITHER_BACKEND], ids=lambda b: b.name)
def test_a_block_for_either_backend_runs_on_torch_too(block, tmp_path):
    assert "KERAS_BACKEND" in block.code, f"{block.name} leaves the backend to the reader's shell"
    _run_as_pasted(block, tmp_path, shell_backend="torch")


def _run_as_pasted(block: Block, tmp_path: Path, shell_backend: str | None) -> None:
    """``block`` in a fresh process, in a reader's shell (``KERAS_BACKEND=shell_backend`` where given)."""
    (tmp_path / "snippet.py").write_text(block.code)
    # a reader's shell: no XLA_FLAGS (the test sessions set 4 CPU devices); one thread a process on 2 cores
    env = {key: value for key, value in os.environ.items() if key not in ("KERAS_BACKEND", "XLA_FLAGS")}
    env.update(OMP_NUM_THREADS="1")
    if chosen := shell_backend or backend(block.code):
        env["KERAS_BACKEND"] = chosen
    done = subprocess.run(
        [sys.executable, "snippet.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    where = f"{block.name}, the block at line {block.line}, KERAS_BACKEND={chosen or 'as the block sets it'}"
    assert done.returncode == 0, f"{where} failed as pasted:\n{done.stderr[-4000:]}"
    if pattern := LAST_LINE.get(block.name):
        last = done.stdout.strip().splitlines()[-1]
        assert re.fullmatch(pattern, last), f"{where} printed {last!r}"
