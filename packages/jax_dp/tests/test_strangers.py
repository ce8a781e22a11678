"""Strangers on the host of a single-host job: another local user's processes, and another job
of the same user without the job's secret. None of them joins the job, reads its secret, reaches
jax's coordinator, or stops it.

The other user is created when the tests run as root (CI does); otherwise they are skipped,
saying so. Unit-level cases (process 0 in a thread) are in test_handshake.py.
"""

from __future__ import annotations

import os
import pwd
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from jax_dp_helpers import Thread, free_port, start_workers

import jax_dp
from jax_dp._processes import local
from jax_dp._processes.admission import admit
from jax_dp._processes.cluster import JobId
from jax_dp._processes.handshake import join

STRANGER = "kdp-jax-stranger"
WORKER = os.path.join(os.path.dirname(__file__), "jax_dp_mp_worker.py")
WORKER_TIMEOUT_S = 180
NO_JOB = JobId(None, "no job_id= and no scheduler's job id")
ENV = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1"}
ENV.pop("KERAS_DP_JOB_SECRET", None)

pytestmark = pytest.mark.timeout(WORKER_TIMEOUT_S + 60)


def as_stranger(code: str, *arguments: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -c code`` as another local user (created if absent), with a HOME of its own."""
    if os.geteuid() != 0:
        pytest.skip("needs root: it creates another local user and runs a process as that user (CI runs as root)")
    try:
        user = pwd.getpwnam(STRANGER)
    except KeyError:
        useradd = ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", STRANGER]
        subprocess.run(useradd, check=True, capture_output=True, timeout=30)
        user = pwd.getpwnam(STRANGER)
    home = tempfile.mkdtemp(prefix="kdp-stranger-")
    os.chown(home, user.pw_uid, user.pw_gid)
    become = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--"]
    env = {**ENV, "HOME": home, "TMPDIR": home}
    if closed := closed_to_others(become, env, home):
        pytest.skip(f"another local user cannot run this Python with jax and this checkout: {closed}")
    command = [*become, sys.executable, "-c", code, *arguments]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=home)


def closed_to_others(become: list[str], env: dict[str, str], home: str) -> str | None:
    """Why the other user cannot run this Python with jax and this checkout, or None."""
    code = "import importlib.util as u; print(all(u.find_spec(m) for m in ('jax', 'jax_dp', 'dp_core', 'numpy')))"
    probe = [*become, sys.executable, "-c", code]
    done = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=60, cwd=home)
    return None if done.stdout.strip() == "True" else (done.stderr.strip().splitlines() or ["no output"])[-1]


FOREIGN_JOINER = """
import sys
try:
    open(sys.argv[1]).read()
    print("READ THE SECRET")
except PermissionError:
    print("DENIED")
import jax_dp
jax_dp.initialize("127.0.0.1:" + sys.argv[2], num_processes=2, process_id=1, initialization_timeout=15)
"""


@pytest.mark.multiprocess  # with the 2-process runs: the interpreter they run on is one another user can start
def test_another_user_can_neither_read_the_generated_secret_nor_join():
    # Before: another user's process 1, with no job id like this job, was admitted in its place.
    port = free_port()
    address = f"127.0.0.1:{port}"
    coordinator = Thread(admit, address, address, 2, NO_JOB, 60, None)
    coordinator.start()
    path = local.secret_path(port)
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    foreign = as_stranger(FOREIGN_JOINER, str(path), str(port))
    print(f"the other user's process stopped after {time.monotonic() - started:.1f} s")
    assert foreign.stdout.strip() == "DENIED", foreign.stdout + foreign.stderr[-3000:]
    assert foreign.returncode == 1, foreign.stderr[-3000:]
    assert f"found a process 0 at '{address}' but no secret of this user's job there" in foreign.stderr
    assert "that process 0 belongs to another user" in foreign.stderr
    assert coordinator.is_alive()  # still waiting for its own process 1

    own = Thread(join, address, 1, 2, NO_JOB, 20, None)
    own.start()
    for thread in (coordinator, own):
        thread.join(timeout=10)
        assert not thread.is_alive() and thread.error is None, thread.error


FOREIGN_CLIENT = """
import socket, sys, time
for path in sys.argv[1:]:
    try:
        socket.socket(socket.AF_UNIX).connect(path)
        print("REACHED", path)
    except PermissionError:
        print("DENIED")
import jax
started = time.monotonic()
try:
    jax.distributed.initialize(coordinator_address="127.0.0.1:" + PORT, num_processes=2, process_id=1,
                               initialization_timeout=1)
finally:
    print(f"TOOK {time.monotonic() - started:.1f}", flush=True)
"""


def assert_matches(output: str, expected: dict[str, np.ndarray]) -> None:
    with np.load(output) as got:
        assert set(got.files) == set(expected)
        for name, want in expected.items():
            np.testing.assert_allclose(got[name], want, atol=1e-5, rtol=1e-5, err_msg=name)


def wait_until(condition, what: str, workers: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    while not condition():
        assert all(worker.poll() is None for worker in workers), f"a worker ended before {what}"
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.1)


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.mark.multiprocess
@pytest.mark.heavy  # among bare nox's slowest (its budget): nox -s heavy, and the fault matrix
def test_strangers_neither_join_nor_stop_a_running_job_that_trains_right(tmp_path):
    # Before: a same-user process without the job's secret took process 1's place, and another
    # user's plain jax.distributed.initialize aborted both processes (SIGABRT, "different incarnation").
    expected = load_worker_module().scenario(jax_dp.Trainer(4))
    port, go, output = free_port(), tmp_path / "go", str(tmp_path / "process0.npz")
    job = {"JAX_DP_TEST_HOLD_UNTIL": str(go), "KERAS_DP_JOB_SECRET": secrets.token_hex(16)}
    arguments = [str(port), "0", output]
    workers: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    try:
        for process_id in range(2):
            (tmp_path / str(process_id)).mkdir()
            started, paths = start_workers(
                WORKER, [[*arguments[:1], str(process_id), output]], tmp_path / str(process_id), [job]
            )
            workers += started
            logs += paths
            if process_id == 0:  # before the real process 1: a same-user process of another job
                wait_until(lambda: listening(port), "process 0 listened", workers)
                code = f"import jax_dp; jax_dp.initialize('127.0.0.1:{port}', 2, 1, initialization_timeout=20)"
                other_secret = {"KERAS_DP_JOB_SECRET": secrets.token_hex(16)}
                foreign = subprocess.run(
                    [sys.executable, "-c", code], env=ENV | other_secret, capture_output=True, text=True, timeout=120
                )
                assert foreign.returncode == 1, foreign.stderr[-3000:]
                assert (
                    f"the process 0 listening at '127.0.0.1:{port}' does not hold this job's secret" in foreign.stderr
                )
        wait_until(
            lambda: all("JOINED" in path.read_text(errors="replace") for path in logs), "the job started", workers
        )

        sockets = [str(path) for path in local.user_folder().glob(f"jax-{port}-*.sock")]
        assert len(sockets) == 1, sockets  # jax's coordinator, on a Unix socket in this user's folder
        client = as_stranger(FOREIGN_CLIENT.replace("PORT", repr(str(port))), *sockets)
        assert client.stdout.startswith("DENIED"), client.stdout + client.stderr[-3000:]
        assert client.returncode != 0, client.stdout + client.stderr[-3000:]
        time.sleep(2)
        assert [worker.poll() for worker in workers] == [None, None]  # the job still runs
        go.touch()
        for worker in workers:
            worker.wait(timeout=WORKER_TIMEOUT_S)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait(timeout=10)
    for worker, path in zip(workers, logs, strict=True):
        assert worker.returncode == 0, path.read_text(errors="replace")[-3000:]
    assert "refused a process: a process that does not hold this job's secret" in logs[0].read_text()
    assert_matches(output, expected)
    assert not local.secret_path(port).exists() and not any(Path(path).exists() for path in sockets)


def load_worker_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("jax_dp_mp_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
