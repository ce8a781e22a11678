"""``python -m jax_dp.doctor``: run as a user would, in a process of its own."""

import os
import re
import subprocess
import sys

import pytest

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}


def doctor(**variables: str) -> dict[str, dict[str, str]]:
    """The report's sections, each ``{name: value}``, after checking its frame."""
    unset = {"KERAS_BACKEND", "XLA_FLAGS", *TORCHRUN}
    env = {k: v for k, v in os.environ.items() if k not in unset and not k.startswith("SLURM")}
    done = subprocess.run(
        [sys.executable, "-m", "jax_dp.doctor"], env={**env, **variables}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "```text" and lines[-1] == "```", done.stdout
    assert re.fullmatch(r"jax_dp doctor \(Keras 3\.\S+ on jax\): paste this into a bug report", lines[1]), lines[1]
    sections: dict[str, dict[str, str]] = {}
    for line in lines[2:-1]:
        if line and not line.startswith("  "):
            heading = sections.setdefault(line, {})
        elif line:
            name, value = line.strip().split(": ", 1)
            heading[name] = value
    return sections


@pytest.mark.timeout(300)
def test_the_report_names_versions_devices_launcher_and_settings():
    found = doctor(KERAS_BACKEND="jax", XLA_FLAGS="--xla_force_host_platform_device_count=3")
    assert list(found) == [
        "versions",
        "host",
        "launcher found",
        "settings",
        "jax devices",
        "jax_dp.initialize()",
    ]
    for package in ("python", "keras", "dp-core", "jax-dp", "jax", "jaxlib", "optax"):
        assert re.match(r"\d+\.\d+", found["versions"][package]), (package, found["versions"][package])
    settings = found["settings"]
    assert settings["XLA_FLAGS"] == "--xla_force_host_platform_device_count=3" and settings["KERAS_BACKEND"] == "jax"
    assert found["jax devices"]["devices"] == "3: cpu (cpu); jax_dp.Trainer() trains on all of them"
    assert found["jax devices"]["processes"] == "1 (this one: 0)"
    expected = "none: one process; several need torchrun, srun or initialize(...)'s arguments"
    assert found["jax_dp.initialize()"] == {"launcher": expected}


@pytest.mark.timeout(300)
def test_one_cpu_device_says_how_to_get_more_and_torchrun_is_read():
    found = doctor(**TORCHRUN)  # KERAS_BACKEND unset: import jax_dp chooses jax, the report says it was unset
    assert found["settings"]["KERAS_BACKEND"] == "jax (changed in this process; not set when it started)"
    assert found["jax devices"]["devices"] == "1: cpu (cpu); jax_dp.Trainer() trains on all of them"
    assert found["jax devices"]["one CPU device"].startswith("XLA_FLAGS=--xla_force_host_platform_device_count=N")
    expected = "would join as process 1 of 2, coordinator node01:29501"  # torchrun's port + 1
    assert found["jax_dp.initialize()"] == {"launcher": expected}
