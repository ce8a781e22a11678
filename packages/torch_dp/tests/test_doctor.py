"""``python -m torch_dp.doctor``: run as a user would, in a process of its own; ``report`` of other variables here."""

import os
import re
import subprocess
import sys

import pytest

import torch_dp.doctor

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}


def _environment(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"KERAS_BACKEND", *TORCHRUN} and not k.startswith("SLURM")}
    return {**env, **variables}


def doctor(**variables: str) -> dict[str, dict[str, str]]:
    """``python -m torch_dp.doctor``'s sections, each ``{name: value}``, after checking its frame."""
    done = subprocess.run(
        [sys.executable, "-m", "torch_dp.doctor"], env=_environment(**variables), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return sections_of(done.stdout)


def sections_of(report: str) -> dict[str, dict[str, str]]:
    lines = report.strip().splitlines()
    assert lines[0] == "```text" and lines[-1] == "```", report
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


def test_under_torchrun_the_report_names_this_process_s_place():
    # in this process (the module run as a user runs it is the test above): the report of torchrun's variables
    found = sections_of(torch_dp.doctor.report(_environment(KERAS_BACKEND="torch", **TORCHRUN)))
    assert found["settings"]["KERAS_BACKEND"] == "torch"
    assert found["launcher found"]["launcher"] == "torchrun: rank 1 of 2, meeting at node01:29500"
    expected = "torchrun: this process trains as rank 1 of 2 (local rank 1), meeting at node01:29500"
    assert found["torch_dp.Trainer()"] == {"launcher": expected}
