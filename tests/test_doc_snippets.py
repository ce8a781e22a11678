"""The getting-started pages' Python, run as written (the package READMEs, which those pages include).

About a minute (the torch page starts 2 replicas): ``nox -s docs`` runs it after the build, not
bare ``nox``.

Each fenced ``python`` block is taken from the page's source; what a block leaves to the reader
(the data ``x, y``) is the only thing added, tiny, before it. Blocks that need a cluster or a
library the page tells you to bring (a Flax module, ``jax_dp.initialize`` on two hosts) are named
in ``NOT_RUN`` with the reason, so a new block is run unless someone says why not.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCED = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
TINY_DATA = """
import numpy as np
rng = np.random.default_rng(0)
x, xv = rng.random((512, 784)).astype("float32"), rng.random((128, 784)).astype("float32")
y, yv = rng.integers(0, 10, 512), rng.integers(0, 10, 128)
"""
NOT_RUN = {
    ("packages/jax_dp/README.md", 3): "needs the reader's Flax module (MyFlaxModule)",
    ("packages/jax_dp/README.md", 4): "jax_dp.initialize on two hosts (tests_jax runs it on 127.0.0.1)",
}


def blocks(page):
    return FENCED.findall((ROOT / page).read_text())


def _run(script, tmp_path, **environment):
    (tmp_path / "snippet.py").write_text(script)
    env = {key: value for key, value in os.environ.items() if key not in ("KERAS_BACKEND", "XLA_FLAGS")}
    env.update(environment, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "snippet.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_every_block_is_run_or_says_why_not():
    counts = {page: len(blocks(page)) for page in ("packages/torch_dp/README.md", "packages/jax_dp/README.md")}
    assert counts == {"packages/torch_dp/README.md": 1, "packages/jax_dp/README.md": 4}, "a block was added: run it"
    assert all(index <= counts[page] for page, index in NOT_RUN)


@pytest.mark.timeout(300)
def test_the_torch_page_runs_as_written(tmp_path):
    (script,) = blocks("packages/torch_dp/README.md")
    out = _run(script, tmp_path)  # it sets KERAS_BACKEND and makes its own data
    # its last line prints evaluate's [loss, accuracy] and the predictions' shape: every row, in input order
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"\[\d+\.\d+, \d+\.\d+\] \(1000, 10\)", last), last


@pytest.mark.timeout(300)
def test_the_jax_page_runs_as_written_on_four_cpu_devices(tmp_path):
    first, optax_block, *_ = blocks("packages/jax_dp/README.md")
    script = TINY_DATA + first.replace("trainer.predict(", "predictions = trainer.predict(")
    script += "\nassert predictions.shape == (128, 10), predictions.shape\nassert trainer.num_replicas == 4\n"
    script += optax_block + "\nprint('optimizer', type(trainer).__name__, 'ok')\n"
    out = _run(script, tmp_path, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    assert out.strip().splitlines()[-1] == "optimizer Trainer ok"
