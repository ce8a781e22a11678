"""``check_equivalence`` says each keras-hub model of the matrix trains on 2 replicas as on one,
on each backend (in a fresh process, its own KERAS_BACKEND)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("hub_equivalence.py")


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_check_equivalence_passes_on_each_keras_hub_model(backend):
    env = dict(os.environ, KERAS_BACKEND=backend, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    verdicts = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(verdicts) == ["bert_classifier", "bert_lora", "gpt2_lm", "vit_classifier"]
    for name, verdict in verdicts.items():
        assert verdict["equivalent"] and verdict["worst"] < 1e-5, (name, verdict)
