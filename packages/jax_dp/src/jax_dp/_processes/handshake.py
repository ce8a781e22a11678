"""Before jax's coordinator starts, process 0 admits its own job's processes, each once.

jax's coordination service checks nobody: a process of another job that connects as task k
aborts the running job. So process 0 first listens on the coordinator's address itself and
admits, for every process id 1..N-1, one process that brings the same job id and the same N;
only then does it close that socket and start jax's service on the port. A process that comes
later reaches jax's gRPC server instead, reads no answer it understands, and stops before it
calls jax.

Each message is one line: the protocol's tag, then JSON. A joiner sends its ``process_id``,
``num_processes`` and job id; process 0 answers ``wait`` at once, ``ok`` once every process is
there, or ``refused`` with the reason.
"""

from __future__ import annotations

import contextlib
import errno
import json
import select
import socket
import sys
import time
from typing import Any

from dp_core import JobId

TAG = b"jax_dp-handshake/1 "
ANSWER_S = 5.0  # process 0 answers a joiner at once: silence or anything else means no handshake there
_RETRY_S = 0.25  # between a joiner's attempts to connect while process 0 is not listening yet
_MAX_LINE = 4096


def admit(bind_address: str, coordinator_address: str, num_processes: int, job: JobId, timeout: float) -> None:
    """Process 0: wait (at most ``timeout`` seconds) until every other process of the job joined."""
    deadline = time.monotonic() + timeout
    joined: dict[int, socket.socket] = {}
    refused: list[str] = []
    try:
        with _listen(bind_address, coordinator_address) as listener:
            while len(joined) < num_processes - 1:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(1, num_processes)) - set(joined))
                    raise TimeoutError(
                        f"jax_dp process 0 waited {timeout:g} s (initialization_timeout) at {coordinator_address!r} "
                        f"for processes {missing} of {num_processes}; none came"
                        + (f", and it refused: {'; '.join(refused)}" if refused else "")
                        + ". Start every process with the same coordinator address, num_processes and job id."
                    )
                listener.settimeout(min(remaining, 1.0))
                try:
                    connection, _ = listener.accept()
                except TimeoutError:
                    continue
                _consider(connection, num_processes, job, joined, refused)
        # The listener is closed: a process that connects from now on finds jax's server or nothing.
        for connection in joined.values():
            with contextlib.suppress(OSError):  # it died meanwhile: jax's own start reports it
                _send(connection, {"answer": "ok"})
    finally:
        for connection in joined.values():
            connection.close()


def _consider(
    connection: socket.socket, num_processes: int, job: JobId, joined: dict[int, socket.socket], refused: list[str]
) -> None:
    """Read one joiner's greeting; keep its connection, or answer why not and close it."""
    connection.settimeout(ANSWER_S)
    try:
        hello = _Messages(connection).read()
        reason = _refusal(hello, num_processes, job, joined)
    except (OSError, ValueError):  # not a jax_dp process (a port scan, a jax client): nothing to answer
        connection.close()
        return
    if reason is None:
        with contextlib.suppress(OSError):
            _send(connection, {"answer": "wait"})
            joined[hello["process_id"]] = connection
            return
    else:
        refused.append(reason)
        print(f"jax_dp: process 0 refused a process: {reason}", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            _send(connection, {"answer": "refused", "reason": reason})
    connection.close()


def _refusal(hello: dict[str, Any], num_processes: int, job: JobId, joined: dict[int, socket.socket]) -> str | None:
    process_id, their_count = hello.get("process_id"), hello.get("num_processes")
    their_job = JobId(hello.get("job"), str(hello.get("job_source")))
    if their_job.value != job.value:
        return (
            f"a process with job id {their_job.value!r} (from {their_job.source}) tried to join job "
            f"{job.value!r} (from {job.source}) as process {process_id}: either it belongs to another job that was "
            "given the same coordinator address (give each job its own port), or the processes of this job were "
            "given different job ids (pass the same job_id= to every process)"
        )
    if their_count != num_processes:
        return (
            f"process {process_id} was started with num_processes={their_count}, process 0 with "
            f"num_processes={num_processes}: give every process the same num_processes"
        )
    if not isinstance(process_id, int) or not 0 < process_id < num_processes:
        return (
            f"process_id={process_id!r} is not one of 1..{num_processes - 1}: process 0 runs the coordinator and "
            "every other process needs its own id below num_processes"
        )
    if process_id in joined:
        if _still_open(joined[process_id]):
            return (
                f"process {process_id} already joined this job: give every process its own process_id (or this "
                "process belongs to another job on the same coordinator address: give each job its own port)"
            )
        joined.pop(process_id).close()  # the earlier one ended: this one takes its place
    return None


def join(coordinator_address: str, process_id: int, num_processes: int, job: JobId, timeout: float) -> None:
    """Process ``process_id`` > 0: be admitted by process 0 (within ``timeout`` seconds) before calling jax."""
    deadline = time.monotonic() + timeout
    connection = _connect(coordinator_address, deadline, timeout)
    with connection:
        hello = {"process_id": process_id, "num_processes": num_processes, "job": job.value, "job_source": job.source}
        connection.settimeout(ANSWER_S)
        answers = _Messages(connection)
        try:
            _send(connection, hello)
            answer = answers.read()
        except (OSError, ValueError):
            raise RuntimeError(
                f"jax_dp process {process_id}: the coordinator address {coordinator_address!r} is held by a job that "
                "already started (or by another program): it did not answer as a jax_dp process 0 waiting for its "
                "processes does, so this process did not join it. Give this job its own port (and check that "
                "num_processes counts every process of the job)."
            ) from None
        if answer.get("answer") == "wait":
            connection.settimeout(max(deadline - time.monotonic(), 0.1))
            try:
                answer = answers.read()
            except TimeoutError:
                raise TimeoutError(
                    f"jax_dp process {process_id} joined process 0 at {coordinator_address!r} but not every one of the "
                    f"{num_processes} processes came within {timeout:g} s (initialization_timeout). Start them all."
                ) from None
            except (OSError, ValueError):
                raise RuntimeError(
                    f"jax_dp process {process_id}: process 0 at {coordinator_address!r} ended while waiting for the "
                    "other processes; see its log."
                ) from None
    if answer.get("answer") != "ok":
        raise RuntimeError(
            f"jax_dp process {process_id} was refused by process 0 at {coordinator_address!r}: "
            f"{answer.get('reason', answer)}."
        )


def _connect(coordinator_address: str, deadline: float, timeout: float) -> socket.socket:
    """A connection to process 0, retried while it does not listen yet."""
    host, port = _split(coordinator_address)
    while True:
        try:
            return socket.create_connection((host, port), timeout=ANSWER_S)
        except OSError as error:
            if time.monotonic() + _RETRY_S >= deadline:
                raise TimeoutError(
                    f"jax_dp found no process 0 listening at {coordinator_address!r} within {timeout:g} s "
                    f"(initialization_timeout; last error: {error}). Start process 0 and give every process its "
                    "address."
                ) from None
            time.sleep(_RETRY_S)


def _listen(bind_address: str, coordinator_address: str) -> socket.socket:
    """Process 0's socket on the coordinator's address: a busy port or another host's address is a
    clear error here, before jax (which only says "Failed to start RPC server", and can crash on exit)."""
    host, port = _split(bind_address)
    try:
        family, kind, protocol, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise RuntimeError(
            f"jax_dp could not start the coordinator at {coordinator_address!r}: {host!r} is not a known host name "
            f"({error}). Give every process process 0's own address."
        ) from None
    listener = socket.socket(family, kind, protocol)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a just-ended run's port is free
    try:
        listener.bind(address)
        listener.listen(64)
    except OSError as error:
        listener.close()
        if error.errno == errno.EADDRNOTAVAIL:
            raise RuntimeError(
                f"jax_dp could not start the coordinator at {coordinator_address!r}: {host} is not an address of "
                "this host, and process 0 runs the coordinator. Give every process process 0's own address."
            ) from None
        raise busy_port(coordinator_address) from None
    return listener


def busy_port(coordinator_address: str) -> RuntimeError:
    return RuntimeError(
        f"jax_dp could not start the coordinator at {coordinator_address!r}: process 0 listens on that address "
        "and its port is in use or not allowed. Pass a free port to every process, e.g. "
        "python -c 'import socket; s=socket.socket(); s.bind((\"\", 0)); print(s.getsockname()[1])' on process "
        "0's host."
    )


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"A coordinator address is 'host:port', e.g. '10.0.0.1:1234'; got {address!r}.")
    return host.strip("[]"), int(port)


def _still_open(connection: socket.socket) -> bool:
    readable, _, _ = select.select([connection], [], [], 0)
    if not readable:
        return True  # nothing to read, not closed
    try:
        return connection.recv(1, socket.MSG_PEEK) != b""
    except OSError:
        return False


def _send(connection: socket.socket, message: dict[str, Any]) -> None:
    connection.sendall(TAG + json.dumps(message).encode() + b"\n")


class _Messages:
    """The messages coming on one connection; ValueError as soon as its bytes are not the
    protocol's (e.g. jax's gRPC server, which speaks first)."""

    def __init__(self, connection: socket.socket) -> None:
        self.connection, self.received = connection, b""

    def read(self) -> dict[str, Any]:
        while b"\n" not in self.received:
            chunk = self.connection.recv(_MAX_LINE)
            if not chunk:
                raise ValueError("closed before a whole message")
            self.received += chunk
            if self.received[: len(TAG)] != TAG[: len(self.received)] or len(self.received) > _MAX_LINE:
                raise ValueError("not a jax_dp handshake")
        line, _, self.received = self.received.partition(b"\n")
        message = json.loads(line[len(TAG) :])
        if not isinstance(message, dict):
            raise ValueError("not a jax_dp handshake")
        return message
