"""Process 0's admission of its job's processes, and what a launcher's variables give, in one process.

The handshake is plain sockets: process 0 and its joiners run here as threads. The real
processes (a latecomer to a running job, two jobs' tokens, srun- and torchrun-style launches)
are in test_multiprocess.py; strangers (another user's processes, a stranger's bytes) in
test_strangers.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest
from jax_dp_helpers import Thread, free_port

import jax_dp
from jax_dp._processes import local
from jax_dp._processes.admission import admit
from jax_dp._processes.cluster import SLURM_VARIABLES, TORCHRUN_VARIABLES, JobId, cluster_of, job_id
from jax_dp._processes.handshake import ANSWER_S, TAG, join, proof

JOB = JobId("job-a", "job_id=")
SECRET = b"the job's secret, 32 characters."
SCHEDULER_VARIABLES = ("TORCHELASTIC_RUN_ID", "SLURM_STEP_ID", "PBS_JOBID", "LSB_JOBID", "JAX_COORDINATOR_PORT")


def joined(address: str, process_id: int, num_processes: int, job: JobId = JOB, timeout: float = 20) -> Thread:
    joiner = Thread(join, address, process_id, num_processes, job, timeout, SECRET)
    joiner.start()
    return joiner


def refusal(joiner: Thread) -> str:
    joiner.join(timeout=ANSWER_S + 5)
    assert not joiner.is_alive() and isinstance(joiner.error, RuntimeError), joiner.error
    return str(joiner.error)


def test_process_0_admits_each_process_once_and_refuses_the_others_with_the_reason(capfd):
    address = f"127.0.0.1:{free_port()}"
    coordinator = Thread(admit, address, address, 3, JOB, 30, SECRET)
    coordinator.start()
    first = joined(address, 1, 3)
    time.sleep(0.5)  # process 1 has joined before its double comes
    assert "process 1 already joined this job" in refusal(joined(address, 1, 3))

    other_job = refusal(joined(address, 2, 3, JobId("job-b", "SLURM_JOB_ID")))
    assert "job id 'job-b' (from SLURM_JOB_ID) tried to join job 'job-a' (from job_id=)" in other_job
    assert "another job that was given the same coordinator address" in other_job
    assert "pass the same job_id= to every process" in other_job

    assert "num_processes=4, process 0 with num_processes=3" in refusal(joined(address, 2, 4))
    assert "process_id=3 is not one of 1..2" in refusal(joined(address, 3, 3))
    assert "process_id=0 is not one of 1..2" in refusal(joined(address, 0, 3))
    assert first.is_alive() and coordinator.is_alive()  # still waiting for process 2

    last = joined(address, 2, 3)
    for thread in (coordinator, first, last):
        thread.join(timeout=10)
        assert not thread.is_alive() and thread.error is None, thread.error
    assert capfd.readouterr().err.count("jax_dp: process 0 refused a process:") == 5
    with socket.create_server(("127.0.0.1", int(address.rsplit(":", 1)[1]))):  # the port is free for jax again
        pass


def test_a_joiner_that_finds_something_else_on_the_port_stops_within_seconds():
    # What a latecomer meets once jax's gRPC server holds the port: it speaks first, and not our protocol.
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = f"127.0.0.1:{server.getsockname()[1]}"

        def serve() -> None:
            connection, _ = server.accept()
            with connection:
                connection.sendall(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00")  # an HTTP/2 SETTINGS frame's header
                time.sleep(2)

        threading.Thread(target=serve, daemon=True).start()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="is held by a job that already started") as raised:
            join(address, 1, 2, JOB, 60, SECRET)
    assert time.monotonic() - started < 2  # at once, not after ANSWER_S or initialization_timeout
    assert "Give this job its own port" in str(raised.value)


def test_waits_are_bounded_by_initialization_timeout():
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=f"found no process 0 listening at '{address}' within 1 s"):
        join(address, 1, 2, JOB, 1, SECRET)
    coordinator = Thread(admit, address, address, 2, JOB, 2, SECRET)
    coordinator.start()
    assert "job id None" in refusal(joined(address, 1, 2, JobId(None, "no job_id=")))
    coordinator.join(timeout=10)
    assert isinstance(coordinator.error, TimeoutError)
    assert "waited 2 s (initialization_timeout) at" in str(coordinator.error)
    assert "for processes [1] of 2; none came, and it refused: a process with job id None" in str(coordinator.error)
    assert time.monotonic() - started < 10


def test_a_busy_port_is_a_clear_error_at_once():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        with pytest.raises(RuntimeError, match=f"could not start the coordinator at '{address}'.*Pass a free port"):
            admit(address, address, 2, JOB, 60, SECRET)


@pytest.fixture
def no_launcher(monkeypatch):
    for name in (*TORCHRUN_VARIABLES, *SLURM_VARIABLES, *SCHEDULER_VARIABLES, "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_slurm_values_come_from_jax_s_own_detection(no_launcher):
    for name, value in {
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NODELIST": "node[007-008],other",
    }.items():
        no_launcher.setenv(name, value)
    port = 4242 % 2**12 + 65535 - 2**12 + 1  # jax's port for that job
    assert cluster_of(None, None, None, None, 60) == (f"node007:{port}", 4, 3, [1])
    assert cluster_of("10.0.0.1:99", None, None, [0, 1], 60) == ("10.0.0.1:99", 4, 3, [0, 1])  # given ones win
    no_launcher.setenv("CUDA_VISIBLE_DEVICES", "5")  # --gpus-per-task 1
    assert cluster_of(None, None, None, None, 60).local_device_ids == [0]
    assert cluster_of(None, None, None, [1], 60).local_device_ids == [1]  # given: as given
    no_launcher.delenv("CUDA_VISIBLE_DEVICES")
    no_launcher.setenv("JAX_COORDINATOR_PORT", "1234")
    assert cluster_of(None, None, None, None, 60).coordinator_address == "node007:1234"
    assert job_id(None) == ("4242", "SLURM_JOB_ID")
    no_launcher.setenv("SLURM_STEP_ID", "2")
    assert job_id(None) == ("4242.2", "SLURM_JOB_ID.SLURM_STEP_ID")
    assert job_id("mine") == ("mine", "job_id=")


def test_torchrun_values_win_over_slurm_s(no_launcher):
    for name, value in {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}.items():
        no_launcher.setenv(name, value)
    no_launcher.setenv("SLURM_STEP_NODELIST", "node1")
    for name, value in {"MASTER_ADDR": "node3", "MASTER_PORT": "29500", "RANK": "5", "WORLD_SIZE": "8"}.items():
        no_launcher.setenv(name, value)
    no_launcher.setenv("LOCAL_RANK", "1")
    assert cluster_of(None, None, None, None, 60) == ("node3:29501", 8, 5, [1])  # torchrun's store holds 29500
    no_launcher.setenv("CUDA_VISIBLE_DEVICES", "3")  # one GPU per process: it is device 0 there
    assert cluster_of(None, None, None, None, 60).local_device_ids == [0]
    no_launcher.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert cluster_of(None, None, None, None, 60).local_device_ids == [1]
    no_launcher.delenv("CUDA_VISIBLE_DEVICES")
    no_launcher.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default: not an id of this job
    assert job_id(None) == ("1", "SLURM_JOB_ID")
    no_launcher.setenv("TORCHELASTIC_RUN_ID", "run-7")
    assert job_id(None) == ("run-7", "TORCHELASTIC_RUN_ID")


def test_no_arguments_and_no_launcher_is_a_clear_error(no_launcher):
    assert job_id(None).value is None
    with pytest.raises(ValueError, match="not given coordinator_address, num_processes, process_id") as raised:
        jax_dp.initialize()
    message = str(raised.value)
    assert "neither torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)" in message
    assert "nor SLURM's (SLURM_JOB_ID, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NODELIST)" in message
    assert "or pass coordinator_address=" in message
    with pytest.raises(ValueError, match="not given process_id and found no launcher"):
        jax_dp.initialize("127.0.0.1:1", num_processes=2)


def stranger(address: str) -> socket.socket:
    """A connection to process 0 (retried while it does not listen yet)."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + 10
    while True:
        try:
            return socket.create_connection((host, int(port)), timeout=10)
        except ConnectionRefusedError:
            assert time.monotonic() < deadline, "process 0 never listened"
            time.sleep(0.05)


def read_line(connection: socket.socket) -> dict:
    received = b""
    while not received.endswith(b"\n"):
        chunk = connection.recv(4096)
        assert chunk, "closed"
        received += chunk
    return json.loads(received[len(TAG) :])


def test_a_stranger_s_malformed_line_is_ignored_and_the_job_forms(capfd):
    # '[' * 3000 made json.loads raise RecursionError, which ended process 0.
    address = f"127.0.0.1:{free_port()}"
    coordinator = Thread(admit, address, address, 2, JOB, 30, SECRET)
    coordinator.start()
    strangers = []
    for line in (TAG + b"[" * 3000 + b"\n", TAG + b"[" * 900 + b"\n", TAG + b"\xff\xfe\n", b"GET / HTTP/1.1\r\n\r\n"):
        strangers.append(stranger(address))
        strangers[-1].sendall(line)
    for connection in strangers:  # process 0 closed each of them without an answer
        assert_closed(connection)
        connection.close()
    first = joined(address, 1, 2)
    for thread in (coordinator, first):
        thread.join(timeout=10)
        assert not thread.is_alive() and thread.error is None, thread.error
    assert "refused" not in capfd.readouterr().err  # strangers' bytes are not refusals of processes


def test_a_stranger_trickling_bytes_delays_no_one():
    # One byte every 3 s used to hold process 0, and the real process 1 gave up after ANSWER_S.
    address = f"127.0.0.1:{free_port()}"
    coordinator = Thread(admit, address, address, 2, JOB, 30, SECRET)
    coordinator.start()
    slow, connected = stranger(address), time.monotonic()

    def trickle() -> None:
        with contextlib.suppress(OSError):
            for byte in TAG * 10:
                slow.sendall(bytes([byte]))
                time.sleep(3)

    threading.Thread(target=trickle, daemon=True).start()
    time.sleep(0.5)  # the stranger is in first
    started = time.monotonic()
    first = joined(address, 1, 2)
    for thread in (coordinator, first):
        thread.join(timeout=10)
        assert not thread.is_alive() and thread.error is None, thread.error
    assert time.monotonic() - started < 2  # admitted at once, not after the stranger
    slow.settimeout(ANSWER_S + 5)
    assert_closed(slow)
    assert time.monotonic() - connected < ANSWER_S + 1  # process 0 dropped it at its deadline
    slow.close()


def assert_closed(connection: socket.socket) -> None:
    """Process 0 closed ``connection`` without an answer (a reset, when our bytes were unread)."""
    with contextlib.suppress(ConnectionResetError):
        assert connection.recv(4096) == b""


def test_a_process_without_the_job_s_secret_is_refused_and_the_real_one_joins(capfd):
    address = f"127.0.0.1:{free_port()}"
    coordinator = Thread(admit, address, address, 2, JOB, 30, SECRET)
    coordinator.start()
    foreign = Thread(join, address, 1, 2, JOB, 20, b"another job's secret, 32 chars..")
    foreign.start()
    message = refusal(foreign)
    assert f"the process 0 listening at '{address}' does not hold this job's secret" in message
    assert "set the same KERAS_DP_JOB_SECRET for every process of the job" in message
    assert coordinator.is_alive()
    first = joined(address, 1, 2)
    for thread in (coordinator, first):
        thread.join(timeout=10)
        assert not thread.is_alive() and thread.error is None, thread.error
    assert "process 0 refused a process: a process that does not hold this job's secret" in capfd.readouterr().err


def test_neither_a_reflected_nor_a_replayed_proof_passes(capfd):
    address = f"127.0.0.1:{free_port()}"
    coordinator = Thread(admit, address, address, 2, JOB, 30, SECRET)
    coordinator.start()
    hello = {"process_id": 1, "num_processes": 2, "job": JOB.value, "job_source": JOB.source, "nonce": "a" * 32}
    line = TAG + json.dumps(hello).encode()
    with stranger(address) as reflecting:  # sends process 0's own proof back
        reflecting.sendall(line + b"\n")
        challenge = read_line(reflecting)
        reflecting.sendall(TAG + json.dumps({"proof": challenge["proof"]}).encode() + b"\n")
        assert_closed(reflecting)
    # A proof recorded from an earlier exchange (computed here with the secret) for the same hello:
    recorded = proof(SECRET, b"process k", challenge["nonce"].encode(), b"a" * 32, line)
    with stranger(address) as replaying:
        replaying.sendall(line + b"\n")
        assert read_line(replaying)["nonce"] != challenge["nonce"]  # process 0's nonce is new each time
        replaying.sendall(TAG + json.dumps({"proof": recorded}).encode() + b"\n")
        assert_closed(replaying)
    assert coordinator.is_alive()
    first = joined(address, 1, 2)
    for thread in (coordinator, first):
        thread.join(timeout=10)
        assert not thread.is_alive() and thread.error is None, thread.error
    assert capfd.readouterr().err.count("a process that does not hold this job's secret tried to join") == 2


def test_on_one_host_process_0_generates_the_secret_in_a_file_only_this_user_reads():
    port = free_port()
    address = f"127.0.0.1:{port}"
    coordinator = Thread(admit, address, address, 2, JOB, 30, None)
    coordinator.start()
    path = local.secret_path(port)
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.stat().st_uid == path.parent.stat().st_uid == os.getuid()
    first = Thread(join, address, 1, 2, JOB, 20, None)  # no secret given: it reads process 0's
    first.start()
    for thread in (coordinator, first):
        thread.join(timeout=10)
        assert not thread.is_alive() and thread.error is None, thread.error
    assert not path.exists()  # removed once every process joined (jax's coordinator has the port now)


def test_a_new_secret_removes_those_killed_jobs_left_and_keeps_a_running_jobs():
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, alive = local.secret_path(free_port()), local.secret_path(free_port())
    dead.write_text(json.dumps({"secret": "a killed job's", "pid": int(ended.stdout)}))
    alive.write_text(json.dumps({"secret": "a running job's", "pid": os.getpid()}))
    try:
        _, path = local.create_secret(free_port())
        path.unlink()
        assert not dead.exists()
        assert json.loads(alive.read_text())["secret"] == "a running job's"
    finally:
        for left in (dead, alive):
            left.unlink(missing_ok=True)


def test_with_a_generated_secret_a_place_claimed_twice_stops_the_job():
    # Two jobs of one user on one port share the generated secret: process 0 cannot tell whose
    # process 1 is whose, so it admits neither rather than train with the other job's.
    address = f"127.0.0.1:{free_port()}"
    coordinator = Thread(admit, address, address, 3, JOB, 30, None)
    coordinator.start()
    first = Thread(join, address, 1, 3, JOB, 20, None)
    first.start()
    time.sleep(1)
    second = Thread(join, address, 1, 3, JOB, 20, None)
    second.start()
    for thread in (coordinator, first, second):
        thread.join(timeout=10)
        assert not thread.is_alive() and isinstance(thread.error, RuntimeError), thread.error
    assert "two processes claimed to be process 1 of the job at" in str(coordinator.error)
    assert "two jobs of this user were started on one port at once" in str(coordinator.error)
    assert "export KERAS_DP_JOB_SECRET=$(python -c" in str(coordinator.error)
    for joiner in (first, second):
        assert "was refused by process 0" in str(joiner.error)
        assert "two processes claimed to be process 1" in str(joiner.error)


@pytest.mark.parametrize("generated", [False, True])
def test_once_formed_a_single_host_job_keeps_its_port_and_refuses_latecomers(generated):
    port = free_port()
    # A killed job of this user may have left its secret file for this port (nothing removes it
    # then): it is not this job's, and would make the last check below read a file no one here wrote.
    local.secret_path(port).unlink(missing_ok=True)
    address, secret = f"127.0.0.1:{port}", None if generated else SECRET
    admission = admit_with_one(address, secret)
    conflicts: list[str] = []
    admission.on_conflict = conflicts.append
    try:
        with pytest.raises(RuntimeError, match="could not start the coordinator"):  # a second process 0
            admit(address, address, 2, JOB, 5, SECRET)
        late = "and process 0 stops that job now: two processes claimed" if generated else "is held by a job that"
        with pytest.raises(RuntimeError, match=late):
            join(address, 1, 2, JOB, 10, secret)
        with pytest.raises(RuntimeError, match="does not hold this job's secret"):
            join(address, 1, 2, JOB, 10, b"another job's secret, 32 chars..")
        # With a generated secret a latecomer may be the real process 1 whose place another job's took.
        assert [("two processes claimed to be process 1" in reason) for reason in conflicts] == [True] * generated
    finally:
        admission.close()
    assert not local.secret_path(port).exists()
    with socket.create_server(("127.0.0.1", port)):  # closed: the port is free again
        pass


def admit_with_one(address: str, secret: bytes | None):
    result: list = []
    coordinator = Thread(lambda: result.append(admit(address, address, 2, JOB, 30, secret, "/nonexistent.sock")))
    coordinator.start()
    first = Thread(join, address, 1, 2, JOB, 20, secret)
    first.start()
    for thread in (coordinator, first):
        thread.join(timeout=10)
        assert not thread.is_alive() and thread.error is None, thread.error
    return result[0]


@pytest.mark.parametrize("process_id", [0, 1])
def test_a_coordinator_other_hosts_reach_needs_the_job_s_secret(monkeypatch, process_id):
    monkeypatch.delenv("KERAS_DP_JOB_SECRET", raising=False)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="'192.0.2.1:1234' is reachable from other hosts") as raised:
        jax_dp.initialize("192.0.2.1:1234", num_processes=2, process_id=process_id, initialization_timeout=30)
    assert time.monotonic() - started < 1  # before anything listens or connects
    assert "KERAS_DP_JOB_SECRET is not set" in str(raised.value)
    assert 'export KERAS_DP_JOB_SECRET=$(python -c "import secrets; print(secrets.token_hex(16))")' in str(raised.value)
    monkeypatch.setenv("KERAS_DP_JOB_SECRET", "short")
    with pytest.raises(ValueError, match="KERAS_DP_JOB_SECRET is set but holds 5 characters"):
        jax_dp.initialize("192.0.2.1:1234", num_processes=2, process_id=process_id, initialization_timeout=30)
