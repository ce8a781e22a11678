"""``python -m torch_dp.doctor``: run as a user would, in a process of its own."""

import os
import re
import subprocess
import sys

import pytest

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}


def doctor(**variables: str) -> dict[str, dict[str, str]]:
    """The report's sections, each ``{name: value}``, after checking its frame."""
    env = {k: v for k, v in os.environ.items() if k not in {"KERAS_BACKEND", *TORCHRUN} and not k.startswith("SLURM")}
    done = subprocess.run(
        [sys.executable, "-m", "torch_dp.doctor"], env={**env, **variables}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "```text" and lines[-1] == "```", done.stdout
    assert re.fullmatch(r"torch_dp doctor \(Keras 3\.\S+ on torch\): paste this into a bug report", lines[1]), lines[1]
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
    found = doctor(MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1")
    assert list(found) == [
        "versions",
        "host",
        "launcher found",
        "settings",
        "torch devices",
        "torch_dp.Trainer()",
    ]
    for package in ("python", "keras", "dp-core", "torch-dp", "torch"):
        assert re.match(r"\d+\.\d+", found["versions"][package]), (package, found["versions"][package])
    assert re.fullmatch(r"\d+ intra-op, \d+ inter-op", found["torch devices"]["threads"])
    settings = found["settings"]
    assert settings["OMP_NUM_THREADS"] == "1" and settings["MALLOC_ARENA_MAX"] == "2"
    # import torch_dp set KERAS_BACKEND=torch in the process: the report says the user had not
    assert settings["KERAS_BACKEND"] == "torch (changed in this process; not set when it started)"
    assert found["launcher found"]["launcher"] == "none (no torchrun, SLURM, Ray, PBS or LSF variables)"
    trainer = found["torch_dp.Trainer()"]
    assert trainer["launcher"].startswith("spawn: this process is replica 0")
    gpus = len([name for name in found["torch devices"] if name.startswith("cuda:")])
    expected = f"one replica per GPU ({gpus})" if gpus else "refused: no GPU, so pass num_replicas=N"
    assert trainer["Trainer()"] == expected


@pytest.mark.timeout(300)
def test_under_torchrun_the_report_names_this_process_s_place():
    found = doctor(KERAS_BACKEND="torch", **TORCHRUN)
    assert found["settings"]["KERAS_BACKEND"] == "torch"
    assert found["launcher found"]["launcher"] == "torchrun: rank 1 of 2, meeting at node01:29500"
    expected = "torchrun: this process trains as rank 1 of 2 (local rank 1), meeting at node01:29500"
    assert found["torch_dp.Trainer()"] == {"launcher": expected}
