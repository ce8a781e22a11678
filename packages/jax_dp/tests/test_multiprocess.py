"""2 processes x 2 host devices (jax.distributed on 127.0.0.1, gloo) train like 1 process x 4."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from jax_dp_helpers import free_port

import jax_dp

WORKER = os.path.join(os.path.dirname(__file__), "jax_dp_mp_worker.py")
WORKER_TIMEOUT_S = 180

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(WORKER_TIMEOUT_S + 60)]


def run_two_processes(output: str, log_dir: str) -> None:
    port = free_port()
    env = {
        **os.environ,
        "KERAS_BACKEND": "jax",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "OMP_NUM_THREADS": "1",  # two processes share the cores
    }
    workers, logs = [], []
    try:
        for process_id in range(2):
            log = open(os.path.join(log_dir, f"worker{process_id}.log"), "w+")  # noqa: SIM115
            logs.append(log)
            workers.append(
                subprocess.Popen(
                    [sys.executable, WORKER, str(port), str(process_id), output], env=env, stdout=log, stderr=log
                )
            )
        for worker in workers:
            worker.wait(timeout=WORKER_TIMEOUT_S)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait(timeout=10)
    for process_id, (worker, log) in enumerate(zip(workers, logs, strict=True)):
        log.seek(0)
        tail = log.read()[-3000:]
        log.close()
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
