"""benchmarks/gpu_check.py's logic on a machine without a GPU: its weight comparison, the page
section it writes and replaces, how it finds GPUs, and its refusal to run without one."""

import importlib.util
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))  # its sibling modules, as when it runs as a script
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
assert _spec is not None and _spec.loader is not None
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # dataclasses look their module up there
_spec.loader.exec_module(gpu_check)

PAGE = "# Benchmarks\n\nintro\n\n## Machine\n\n- 2 cores\n"


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


def test_the_docs_page_says_the_check_has_not_run_and_how_to_run_it():
    page = (Path(__file__).parents[1] / "docs" / "benchmarks.md").read_text()
    section = gpu_check.section_of(page)
    assert section is not None
    not_run = "No NVIDIA GPU was available" in section and "`nox -s gpu`" in section
    assert not_run or "Written by `nox -s gpu`" in section


def _report():
    run = {"step_s": 0.004, "peak_bytes": 300 * 2**20, "versions": "torch 2.13.0 (CUDA 12.8), Keras 3.15.1"}
    return {
        "date": "2026-12-01 03:00 UTC",
        "machine": {"gpus": ["NVIDIA H200", "NVIDIA H200"], "driver": "570.1", "driver_cuda": "12.8"},
        "steps": 30,
        "backends": {
            "torch": {
                "runs": {"fit": run, "dp1": {**run, "step_s": 0.005}, "dp2": {"skipped": "needs 2 GPUs"}},
                "comparisons": [{"name": "dp1", "max_difference": 3e-7, "ok": True}],
                "problems": [],
                "versions": run["versions"],
            },
            "jax": {
                "runs": {"fit": run, "dp1": run},
                "comparisons": [{"name": "dp1", "max_difference": 0.5, "ok": False}],
                "problems": ["1 replica vs `model.fit`, 1 GPU: weights differ by up to 0.5 (tolerance 0.0001)"],
                "versions": "jax 0.10.2",
            },
        },
    }


def test_the_section_and_summary_carry_the_machine_and_the_numbers():
    section = gpu_check.render_section(_report())
    assert section.startswith("## GPU check\n")
    assert "2 x NVIDIA H200, NVIDIA driver 570.1 (CUDA 12.8)" in section and "2026-12-01" in section
    torch_row = next(line for line in section.splitlines() if line.startswith("| torch | 1 replica |"))
    assert "3.00e-07 | yes | 5.00 ms | 1.25x | 300 MiB" in torch_row
    assert "| jax | 1 replica | `model.fit`, 1 GPU | 5.00e-01 | **no** |" in section
    assert "needs 2 GPUs" in section and "- jax: 1 replica vs" in section
    summary = gpu_check.summary(_report())
    assert "torch: 1 replica vs `model.fit`, 1 GPU: weights within 3.00e-07 (ok), step time 1.25x" in summary
    assert "TOO FAR" in summary


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


def test_without_a_gpu_it_exits_non_zero_saying_so_and_leaves_the_page_alone(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text(PAGE)
    env = {**os.environ, "PATH": str(tmp_path)}  # no nvidia-smi there
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--output", str(page)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == gpu_check.NO_GPU_EXIT != 0
    assert "no NVIDIA GPU found" in done.stderr and f"{page} was left as it is" in done.stderr
    assert page.read_text() == PAGE
