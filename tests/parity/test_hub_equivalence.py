"""``check_equivalence`` says each keras-hub model of the matrix trains on 2 replicas as on one,
on each backend (in a fresh process each, its own KERAS_BACKEND, both at once)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parity.processes import backend_env

SCRIPT = Path(__file__).with_name("hub_equivalence.py")
BACKENDS = ("torch", "jax")


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each backend's verdicts, or what its process wrote when it failed."""
    directory = tmp_path_factory.mktemp("hub_equivalence")
    started = {}
    for backend in BACKENDS:
        env = backend_env(backend, directory.parent / "xla-cache")
        with (directory / f"{backend}.log").open("wb") as log:  # a file: a full pipe would block the process
            started[backend] = subprocess.Popen([sys.executable, str(SCRIPT)], stdout=log, stderr=log, env=env)
    found = {}
    for backend, process in started.items():
        status = process.wait(timeout=900)
        output = (directory / f"{backend}.log").read_text(errors="replace")
        printed = [line for line in output.splitlines() if line.startswith('{"')]  # warnings share the file
        found[backend] = json.loads(printed[-1]) if status == 0 and printed else output[-3000:]
    return found


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_equivalence_passes_on_each_keras_hub_model(verdicts, backend):
    found = verdicts[backend]
    assert isinstance(found, dict), found
    assert sorted(found) == ["bert_classifier", "bert_lora", "gpt2_lm", "vit_classifier"]
    for name, verdict in found.items():
        assert verdict["equivalent"] and verdict["worst"] < 1e-5, (name, verdict)
