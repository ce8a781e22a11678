"""benchmarks/gpu_check.py on a machine without a GPU: its weight comparison, the page section it
writes and replaces, how it finds GPUs, its refusal to run without one, a failing part that
reports while the next runs, and the CPU rehearsal (``--cpu``): every part, on CPU with tiny
sizes, reports numbers, so the kit for the day a GPU is lent cannot rot unnoticed."""

import importlib.util
import json
import math
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))  # its sibling modules, as when it runs as a script
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
assert _spec is not None and _spec.loader is not None
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # dataclasses look their module up there
_spec.loader.exec_module(gpu_check)
page = sys.modules["gpu_check_page"]

PAGE = "# Benchmarks\n\nintro\n\n## Machine\n\n- 2 cores\n"
TRAINING_PARTS = {
    "torch_float32": 1,
    "torch_mixed_bfloat16": 1,
    "jax_float32": 1,
    "jax_mixed_bfloat16": 1,
    "torch_2_replicas": 2,
    "torch_2_replicas_full": 2,
    "torch_2_replicas_full_prefetch": 2,
    "jax_full": 1,
}


def test_weights_within_tolerance_and_what_counts_as_far():
    weights = [np.ones((2, 3), "float32"), np.zeros(3, "float32")]
    assert gpu_check.compare_weights("dp1", weights, weights, 1e-4).max_difference == 0.0
    shifted = [weights[0] + 2e-4, weights[1]]
    far = gpu_check.compare_weights("dp1", shifted, weights, 1e-4)
    assert not far.ok and np.isclose(far.max_difference, 2e-4, rtol=1e-3)
    assert gpu_check.compare_weights("dp1", shifted, weights, 1e-3).ok
    nan = [np.full((2, 3), np.nan, "float32"), weights[1]]
    assert gpu_check.compare_weights("dp1", nan, weights, 1.0).max_difference == float("inf")
    assert not gpu_check.compare_weights("dp1", [weights[0].T, weights[1]], weights, 1.0).ok
    assert not gpu_check.compare_weights("dp1", weights[:1], weights, 1.0).ok


def test_the_section_is_added_then_replaced_leaving_the_rest_of_the_page():
    first = gpu_check.with_section(PAGE, "## GPU check\n\nold numbers\n")
    assert first == PAGE + "\n## GPU check\n\nold numbers\n"
    middle = first + "\n## Later\n\nkept\n"
    replaced = gpu_check.with_section(middle, "## GPU check\n\nnew numbers")
    assert replaced == PAGE + "\n## GPU check\n\nnew numbers\n\n## Later\n\nkept\n"
    assert gpu_check.section_of(replaced) == "## GPU check\n\nnew numbers\n\n"
    assert gpu_check.with_section(replaced, "## GPU check\n\nnew numbers") == replaced
    assert gpu_check.section_of(PAGE) is None


def test_the_docs_page_says_no_part_has_run_and_gives_the_one_command():
    section = gpu_check.section_of((ROOT / "docs" / "benchmarks.md").read_text())
    assert section is not None
    if "Run by `benchmarks/device_check.sh`" in section:  # recorded from a GPU's results
        assert "a CPU rehearsal" not in section
        return
    assert section == gpu_check.NOT_RUN.format(heading=gpu_check.SECTION_HEADING) + "\n"
    assert "No part of this check has run on a GPU yet" in section
    assert f"command: {page.DEVICE_COMMAND}\n" in section and f"carry: {page.DEVICE_CARRY}" in section
    assert len(page.DEVICE_COMMAND) < 2000 and (ROOT / page.DEVICE_COMMAND.split()[-1]).exists()
    assert ".device-wheels/" in (ROOT / ".gitignore").read_text().splitlines()


def _report():
    torch_part = page.PartResult(
        "torch_float32",
        "torch-dp, 1 replica, float32",
        "passed",
        20.0,
        max_difference=3e-7,
        tolerance=1e-4,
        step_ms=5.0,
        reference_step_ms=4.0,
        peak_mib=[300.0],
        reference_peak_mib=290.0,
        memory="device",
        versions="torch 2.11.0+cu130 (CUDA 13.0), Keras 3.15.1",
    )
    jax_part = page.PartResult(
        "jax_float32", "jax-dp, 1 device, float32", "differs", 9.0, max_difference=0.5, tolerance=1e-4
    )
    broken = page.PartResult(
        "jax_full", 'jax-dp, 1 device, shard="full"', "error", 3.0, detail="jax_dp1_full rank 0 (exit 1): Boom"
    )
    host = page.PartResult(
        "jax_host",
        "jax-dp, host time per step",
        "measured",
        8.0,
        numbers={"fit_ms": 0.3, "trainer_ms": 0.57, "bare_step_ms": 0.29},
    )
    machine = page.Machine(["NVIDIA H200"], "580.159.03", "13.0", cpu=False)
    return page.Report("2026-12-01 03:00 UTC", machine, 330.0, [torch_part, jax_part, broken, host])


def test_the_section_carries_the_machine_each_part_and_its_numbers():
    section = page.render_section(_report())
    assert section.startswith("## GPU check\n")
    assert "1 x NVIDIA H200, NVIDIA driver 580.159.03 (CUDA 13.0)" in section and "2026-12-01" in section
    assert "2 of 4 parts ran to the end (torch_float32, jax_host)" in section
    rows = {line.split(" | ")[0][2:]: line for line in section.splitlines() if line.startswith("| ") and " | " in line}
    assert (
        "| passed | 3.00e-07 (0.0001) | 5.000 / 4.000 ms (1.25x) | 300 / 290 |" in rows["torch-dp, 1 replica, float32"]
    )
    assert "| **differs** | 5.00e-01 (0.0001) |" in rows["jax-dp, 1 device, float32"]
    assert (
        "| **error** |" in rows['jax-dp, 1 device, shard="full"'] and "Boom" in rows['jax-dp, 1 device, shard="full"']
    )
    assert (
        "Trainer 0.570 ms, `model.fit` 0.300 ms a step, bare jitted step 0.290 ms" in rows["jax-dp, host time per step"]
    )
    assert "Versions: torch 2.11.0+cu130 (CUDA 13.0), Keras 3.15.1." in section


def test_a_gpu_report_is_recorded_into_the_page_and_a_cpu_run_is_not(tmp_path):
    results, output = tmp_path / "gpu_check.json", tmp_path / "benchmarks.md"
    output.write_text(PAGE)
    from dataclasses import asdict, replace

    report = _report()
    results.write_text(json.dumps(asdict(replace(report, machine=replace(report.machine, cpu=True)))))
    assert gpu_check.main(["--record", str(results), "--output", str(output)]) == 1
    assert output.read_text() == PAGE
    results.write_text(json.dumps(asdict(report)))
    assert gpu_check.main(["--record", str(results), "--output", str(output)]) == 0
    recorded = gpu_check.section_of(output.read_text())
    assert recorded is not None and recorded.rstrip("\n") == page.render_section(report).rstrip("\n")
    assert output.read_text().startswith(PAGE)


def _fake_nvidia_smi(folder: Path) -> None:
    script = folder / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'if [ -n "$1" ]; then printf "NVIDIA H200, 570.86.15\\nNVIDIA H200, 570.86.15\\n";'
        ' else echo "| NVIDIA-SMI 570.86.15    Driver Version: 570.86.15    CUDA Version: 12.8 |"; fi\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def test_gpus_driver_and_cuda_versions_are_read_from_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_check.nvidia_gpus() == ([], "", "")
    _fake_nvidia_smi(tmp_path)
    assert gpu_check.nvidia_gpus() == (["NVIDIA H200", "NVIDIA H200"], "570.86.15", "12.8")


def test_without_a_gpu_or_cpu_it_exits_non_zero_saying_so_and_writes_nothing(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no nvidia-smi there
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == gpu_check.NO_GPU_EXIT != 0
    assert "no NVIDIA GPU found" in done.stderr and "--cpu" in done.stderr
    assert not out.exists()


def test_a_failing_part_reports_its_error_and_the_next_part_still_runs(tmp_path):
    machine = page.Machine([], "", "", cpu=True)
    broken = [
        gpu_check.Part(
            f"broken_{index}", f"broken {index}", gpu_check.Run(f"broken_{index}", "no-such-backend", cpu=True)
        )
        for index in range(2)
    ]
    report = gpu_check.run_check(broken, machine, tmp_path, budget_s=120, run_timeout_s=60)
    assert [part.status for part in report.parts] == ["error", "error"]
    assert all(f"broken_{index} rank 0 (exit 1)" in part.detail for index, part in enumerate(report.parts))
    assert "==== broken_1, rank 0: exit 1" in (tmp_path / "gpu_check.log").read_text()
    late = gpu_check.run_check(broken, machine, tmp_path, budget_s=0, run_timeout_s=60)
    assert [part.status for part in late.parts] == ["not run", "not run"]
    assert page.Report.from_json(json.loads((tmp_path / "gpu_check.json").read_text())) == late


# ---- the CPU rehearsal ------------------------------------------------------------------


def _importable(*modules: str) -> bool:
    return all(importlib.util.find_spec(module) is not None for module in modules)


BACKENDS = {"torch": _importable("torch", "torch_dp"), "jax": _importable("jax", "jax_dp")}


# Bare nox rehearses one part of each kind of run (a process of each backend against model.fit, several
# replicas with sharded state and prefetch, each measurement); `nox -s heavy` rehearses every part.
LEAN = {"torch_float32", "torch_2_replicas_full_prefetch", "jax_full", "torch_scaling", "jax_host"}


def _lean_or_heavy(names):
    return [pytest.param(name, marks=() if name in LEAN else pytest.mark.heavy) for name in names]


def _parts_selected(session: pytest.Session) -> set[str]:
    """The parts the selected rehearsal tests read (the ``name`` they are parametrized with)."""
    needed = set()
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        if (
            getattr(item, "module", None) is sys.modules[__name__]
            and callspec is not None
            and "name" in callspec.params
        ):
            needed.add(callspec.params["name"])
    return needed or LEAN


@pytest.fixture(scope="module")
def rehearsal(request, tmp_path_factory):
    """The parts of the check the selected tests read, whose backend is installed here (both, in the
    conformance session), on CPU: the report it wrote."""
    out = tmp_path_factory.mktemp("gpu_check")
    needed = _parts_selected(request.session)
    parts = [part.name for part in gpu_check.plan(cpu=True) if BACKENDS[part.run.backend] and part.name in needed]
    if not parts:
        pytest.skip("neither torch_dp nor jax_dp is installed")
    command = [sys.executable, str(SCRIPT), "--cpu", "--out", str(out), "--only", *parts]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    report = page.Report.from_json(json.loads((out / "gpu_check.json").read_text()))
    assert done.returncode == 0, (done.stdout[-3000:], (out / "gpu_check.log").read_text()[-3000:])
    return report, (out / "gpu_check.md").read_text()


def _part(rehearsal, name):
    report, _ = rehearsal
    backend = name.split("_")[0]
    if not BACKENDS[backend]:
        pytest.skip(f"{backend}-dp is not installed here")
    return next(part for part in report.parts if part.name == name)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", _lean_or_heavy(sorted(TRAINING_PARTS)))
def test_rehearsal_each_training_part_matches_model_fit_with_numbers(rehearsal, name):
    part = _part(rehearsal, name)
    assert part.status == "passed", part.detail
    assert part.tolerance is not None and 0 <= part.max_difference <= part.tolerance
    assert part.step_ms > 0 and part.reference_step_ms > 0
    assert len(part.peak_mib) == TRAINING_PARTS[name] and all(peak > 50 for peak in part.peak_mib)
    assert part.reference_peak_mib > 50 and part.memory == "host RSS" and part.device.lower().startswith("cpu")


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", _lean_or_heavy(["torch_scaling", "jax_scaling"]))
def test_rehearsal_scaling_report_gives_mfu_against_a_measured_peak(rehearsal, name):
    numbers = _part(rehearsal, name).numbers
    assert 0 < numbers["mfu"] < 1 and numbers["peak_how"] == "measured"
    assert numbers["flops_per_step"] > 0 and numbers["samples_per_second"] > 0 and numbers["parameters"] > 0
    hub = importlib.util.find_spec("keras_hub") is not None
    assert ("GPT2Backbone" in numbers["model"]) == hub and ("keras-hub is not installed" in numbers["model"]) != hub


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", _lean_or_heavy(["torch_host", "jax_host"]))
def test_rehearsal_host_time_per_step_of_each_trainer_and_model_fit(rehearsal, name):
    part = _part(rehearsal, name)
    assert part.status == "measured"
    assert part.numbers["fit_ms"] > 0 and math.isclose(part.numbers["trainer_ms"], part.step_ms)
    assert ("bare_step_ms" in part.numbers) == name.startswith("jax")


@pytest.mark.timeout(1500)
def test_rehearsal_table_has_a_row_per_part_and_says_it_is_no_gpu_result(rehearsal):
    report, markdown = rehearsal
    assert "a CPU rehearsal" in markdown and "not a GPU result" in markdown
    for part in report.parts:
        assert f"| {part.title} | {part.status} |" in markdown
