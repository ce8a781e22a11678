"""2 processes x 2 host devices (jax.distributed on 127.0.0.1, gloo) train like 1 process x 4.

Also how they join: with no arguments under srun- or torchrun-style variables, and process 0's
admission of its own job's processes (a latecomer to a running job, processes given different
job ids).
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from jax_dp_helpers import free_port, start_workers

import jax_dp

WORKER = os.path.join(os.path.dirname(__file__), "jax_dp_mp_worker.py")
WORKER_TIMEOUT_S = 180
ANSWER_BOUND_S = 5.0  # a latecomer learns it is too late within this (jax_dp's handshake waits ANSWER_S at most)
ENV = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1"}

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(WORKER_TIMEOUT_S + 60)]


def run_two_processes(
    output: str,
    log_dir: str,
    *more: list[str],
    port: str = "",
    environments: list[dict[str, str]] | None = None,
    meanwhile: Callable[[list[subprocess.Popen[bytes]], list[Path]], None] | None = None,
    exit_code: int = 0,
) -> list[str]:
    """The worker in 2 processes; ``more`` holds each process's extra arguments, ``environments``
    its extra variables; ``meanwhile`` runs once they started. Returns their logs, once both ended
    with ``exit_code``."""
    port = port or str(free_port())
    arguments = [[port, str(process_id), output, *(more[process_id] if more else [])] for process_id in range(2)]
    workers, log_paths = start_workers(WORKER, arguments, Path(log_dir), environments)
    try:
        if meanwhile is not None:
            meanwhile(workers, log_paths)
        for worker in workers:
            worker.wait(timeout=WORKER_TIMEOUT_S)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait(timeout=10)
    logs = [log_path.read_text(errors="replace") for log_path in log_paths]
    for process_id, (worker, log) in enumerate(zip(workers, logs, strict=True)):
        assert worker.returncode == exit_code, f"worker {process_id} exited with {worker.returncode}:\n{log[-3000:]}"
    return logs


def load_worker_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("jax_dp_mp_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def one_process_of_four() -> dict[str, np.ndarray]:
    return load_worker_module().scenario(jax_dp.Trainer(4))


def assert_matches(output: str, expected: dict[str, np.ndarray]) -> None:
    with np.load(output) as got:
        assert set(got.files) == set(expected)
        for name, want in expected.items():
            if want.dtype.kind == "U":  # names
                np.testing.assert_array_equal(got[name], want, err_msg=name)
            else:
                np.testing.assert_allclose(got[name], want, atol=1e-5, rtol=1e-5, err_msg=name)


def test_two_processes_of_two_devices_match_one_process_of_four(tmp_path, one_process_of_four):
    """Then the same processes again with shard="full": the first kernel (5x8) lies split over all four
    devices, two on each process; reading it back (every epoch end, evaluate, predict) gathers it from both.
    Then a model built in the trainer's scope, split across both processes from construction: its
    checkpoint holds each process's parts file (no process gathers the state to write it), a new model
    resumes from it, and its weights read back equal one process's of four devices."""
    output = str(tmp_path / "process0.npz")
    environment = {"JAX_DP_TEST_SHARD": "full", "JAX_DP_TEST_SCOPE": str(tmp_path / "shared")}
    run_two_processes(output, str(tmp_path), environments=[environment] * 2)
    sharded = {f"sharded_{name}": value for name, value in one_process_of_four.items()}
    worker = load_worker_module()
    scoped = worker.scoped(str(tmp_path / "one_process"))
    assert list(scoped["scoped_first_files"]) == ["manifest.json", "parts-0.npz", "state.json"]
    scoped["scoped_first_files"] = np.asarray(["manifest.json", "parts-0.npz", "parts-1.npz", "state.json"])
    assert_matches(output, {**one_process_of_four, **sharded, **scoped})
    np.testing.assert_array_equal(scoped["scoped_epochs_run"], [0, 1, 2])  # resumed after epoch 1's checkpoint
    assert one_process_of_four["predictions"].shape == (37, 1)
    assert one_process_of_four["epochs_run_when_stopped"] == 1


def free_slurm_job() -> tuple[str, int]:
    """A SLURM job id whose coordinator port (jax's rule: 61440 + id % 4096) is free on loopback."""
    for job in range(int(time.time()) % 4096, 10**6, 37):
        port = job % 4096 + 61440
        try:
            with socket.create_server(("127.0.0.1", port)):
                return str(job), port
        except OSError:
            continue
    raise AssertionError("no free port in 61440-65535")


# torchrun's variables: nox -s heavy (both launchers are read by one function, cluster_of)
@pytest.mark.parametrize("launcher", ["srun", pytest.param("torchrun", marks=pytest.mark.heavy)])
def test_processes_started_like_srun_or_torchrun_join_with_no_arguments(tmp_path, launcher, one_process_of_four):
    if launcher == "srun":
        job, port = free_slurm_job()
        common = {"SLURM_JOB_ID": job, "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "127.0.0.1"}
        environments = [{**common, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)} for i in range(2)]
    else:
        port = free_port()  # the coordinator's: torchrun's own store holds MASTER_PORT, the one before
        common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port - 1), "WORLD_SIZE": "2"}
        common |= {"LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "run-1"}
        environments = [{**common, "RANK": str(i), "LOCAL_RANK": str(i)} for i in range(2)]
    output = str(tmp_path / "process0.npz")
    logs = run_two_processes(output, str(tmp_path), port="detect", environments=environments)
    for process_id, log in enumerate(logs):
        assert f"JOINED as process {process_id} of 2 at 127.0.0.1:{port}" in log, log[-3000:]
    assert_matches(output, one_process_of_four)


LATECOMER = """
import time, jax_dp
started = time.monotonic()
try:
    jax_dp.initialize("127.0.0.1:{port}", num_processes=2, process_id=1, initialization_timeout=60)
finally:
    print(f"TOOK {{time.monotonic() - started:.2f}}", flush=True)
"""


@pytest.mark.heavy  # among bare nox's slowest (its budget): nox -s heavy, and the fault matrix
def test_a_latecomer_gets_a_clear_error_and_the_running_job_finishes_right(
    tmp_path, one_process_of_four, record_property
):
    # A third process claims to be process 1 of a job on the running job's address: registering
    # with jax's coordinator as task 1 would abort the job; it must stop on its own instead. It holds
    # the job's secret (a generated one would end the job: it cannot tell a latecomer from a stranger).
    port, go = free_port(), tmp_path / "go"
    secret = {"KERAS_DP_JOB_SECRET": secrets.token_hex(16)}
    late: list[subprocess.CompletedProcess[str]] = []

    def latecomer(workers: list[subprocess.Popen[bytes]], log_paths: list[Path]) -> None:
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        while not all("JOINED" in path.read_text(errors="replace") for path in log_paths):
            assert [worker.poll() for worker in workers] == [None, None], "a worker ended before the job started"
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.2)
        code = LATECOMER.format(port=port)
        late.append(
            subprocess.run([sys.executable, "-c", code], env=ENV | secret, capture_output=True, text=True, timeout=120)
        )
        assert [worker.poll() for worker in workers] == [None, None]  # the job still runs
        go.touch()

    output = str(tmp_path / "process0.npz")
    hold = [{"JAX_DP_TEST_HOLD_UNTIL": str(go), **secret}] * 2
    run_two_processes(output, str(tmp_path), port=str(port), environments=hold, meanwhile=latecomer)
    assert_matches(output, one_process_of_four)

    (finished,) = late
    assert finished.returncode == 1, finished.stderr[-3000:]
    assert f"the coordinator address '127.0.0.1:{port}' is held by a job that already started" in finished.stderr
    assert "Give this job its own port" in finished.stderr
    took = float(finished.stdout.split("TOOK ")[1])
    print(f"the latecomer stopped {took:.2f} s after calling jax_dp.initialize")
    assert took < ANSWER_BOUND_S, finished.stdout
    record_property("fault_seconds", took)


@pytest.mark.heavy  # among bare nox's slowest (its budget): nox -s heavy, and the fault matrix
def test_processes_given_different_job_ids_are_refused_at_start_up():
    port = free_port()
    code = (
        "import jax_dp; jax_dp.initialize('127.0.0.1:{port}', num_processes=2, process_id={process_id}, "
        "job_id='{job}', initialization_timeout={timeout})"
    )
    arguments = [(0, "job-a", 20), (1, "job-b", 60)]
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", code.format(port=port, process_id=i, job=job, timeout=timeout)],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, job, timeout in arguments
    ]
    try:
        (_, process_0), (_, joiner) = (process.communicate(timeout=120) for process in processes)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
    assert processes[1].returncode == 1, joiner[-3000:]
    assert "was refused by process 0 at '127.0.0.1:" in joiner
    assert "job id 'job-b' (from job_id=) tried to join job 'job-a' (from job_id=)" in joiner
    assert "another job that was given the same coordinator address (give each job its own port)" in joiner
    assert "the processes of this job were given different job ids (pass the same job_id= to every process)" in joiner
    assert processes[0].returncode == 1, process_0[-3000:]
    assert "jax_dp: process 0 refused a process: a process with job id 'job-b'" in process_0
    assert "TimeoutError: jax_dp process 0 waited 20 s (initialization_timeout)" in process_0
    assert "for processes [1] of 2; none came, and it refused: a process with job id 'job-b'" in process_0


@pytest.mark.heavy  # among bare nox's slowest (its budget): nox -s heavy, and the fault matrix
def test_every_process_resumes_from_process_0s_checkpoint_even_with_a_directory_of_its_own(tmp_path):
    # Per-host checkpoint directories: only process 0 writes, so process 1's stays empty. The
    # second run must still start every process at process 0's checkpoint (epoch 1), with its state.
    directories = [str(tmp_path / f"host{process_id}") for process_id in range(2)]
    output = str(tmp_path / "run")
    run_two_processes(output, str(tmp_path), [directories[0], "1"], [directories[1], "1"])
    assert os.listdir(directories[0]) and not os.path.exists(directories[1])
    scope = [{"JAX_DP_TEST_SCOPE": "1"}] * 2  # then a scoped model: refused before it trains
    logs = run_two_processes(
        output, str(tmp_path), [directories[0], "3"], [directories[1], "3"], environments=scope, exit_code=1
    )
    for log in logs:
        assert "is not one folder every process sees: process(es) [1] cannot see the file process 0 wrote" in log
    assert not os.path.exists(directories[0] + "-scoped/step-000001-000000000")

    expected = load_worker_module().resumed(jax_dp.Trainer(4), str(tmp_path / "one_process"), 3)
    for process_id in range(2):
        with np.load(f"{output}.{process_id}.npz") as got:
            np.testing.assert_array_equal(got["epochs_run"], [0, 1, 2])  # History continues from the checkpoint
            for name, want in expected.items():
                if name.startswith("weight_"):
                    np.testing.assert_allclose(got[name], want, atol=1e-5, rtol=1e-5, err_msg=f"{process_id} {name}")
