"""2 processes x 2 host devices (jax.distributed on 127.0.0.1, gloo) train like 1 process x 4."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from jax_dp_helpers import free_port, start_workers

import jax_dp

WORKER = os.path.join(os.path.dirname(__file__), "jax_dp_mp_worker.py")
WORKER_TIMEOUT_S = 180

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(WORKER_TIMEOUT_S + 60)]


def run_two_processes(output: str, log_dir: str, *more: list[str]) -> None:
    """The worker in 2 processes; ``more`` holds each process's extra arguments."""
    port = str(free_port())
    arguments = [[port, str(process_id), output, *(more[process_id] if more else [])] for process_id in range(2)]
    workers, log_paths = start_workers(WORKER, arguments, Path(log_dir))
    try:
        for worker in workers:
            worker.wait(timeout=WORKER_TIMEOUT_S)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait(timeout=10)
    for process_id, (worker, log_path) in enumerate(zip(workers, log_paths, strict=True)):
        tail = log_path.read_text(errors="replace")[-3000:]
        assert worker.returncode == 0, f"worker {process_id} exited with {worker.returncode}:\n{tail}"


def load_worker_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("jax_dp_mp_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_processes_of_two_devices_match_one_process_of_four(tmp_path):
    output = str(tmp_path / "process0.npz")
    run_two_processes(output, str(tmp_path))
    expected = load_worker_module().scenario(jax_dp.Trainer(4))

    with np.load(output) as got:
        assert set(got.files) == set(expected)
        for name, want in expected.items():
            np.testing.assert_allclose(got[name], want, atol=1e-5, rtol=1e-5, err_msg=name)
    assert expected["predictions"].shape == (37, 1)
    assert expected["epochs_run_when_stopped"] == 1


def test_every_process_resumes_from_process_0s_checkpoint_even_with_a_directory_of_its_own(tmp_path):
    # Per-host checkpoint directories: only process 0 writes, so process 1's stays empty. The
    # second run must still start every process at process 0's checkpoint (epoch 1), with its state.
    directories = [str(tmp_path / f"host{process_id}") for process_id in range(2)]
    output = str(tmp_path / "run")
    run_two_processes(output, str(tmp_path), [directories[0], "1"], [directories[1], "1"])
    assert os.listdir(directories[0]) and not os.path.exists(directories[1])
    run_two_processes(output, str(tmp_path), [directories[0], "3"], [directories[1], "3"])

    expected = load_worker_module().resumed(jax_dp.Trainer(4), str(tmp_path / "one_process"), 3)
    for process_id in range(2):
        with np.load(f"{output}.{process_id}.npz") as got:
            np.testing.assert_array_equal(got["epochs_run"], [0, 1, 2])  # History continues from the checkpoint
            for name, want in expected.items():
                if name.startswith("weight_"):
                    np.testing.assert_allclose(got[name], want, atol=1e-5, rtol=1e-5, err_msg=f"{process_id} {name}")
