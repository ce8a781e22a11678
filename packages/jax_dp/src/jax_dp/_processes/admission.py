"""Process 0's side of the handshake (``handshake`` holds the protocol): it listens on the
coordinator's address and admits each other process of its job once.

Every connection is served in a thread of its own, bounded in bytes and by ``ANSWER_S``: a
stranger's bytes, however many, malformed or slow, are dropped without delaying anyone. When
jax's coordinator goes on a Unix socket (a single-host job), process 0 keeps the port for the
job's whole life: a second process 0 on it fails at once, and a latecomer is refused.

A secret process 0 generated (single host, no ``KERAS_DP_JOB_SECRET``) is the same for every
job of this user on that port, so it cannot tell one such job's process from another's: a place
claimed twice then ends the job, with the reason, instead of letting two jobs train together.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hmac
import os
import secrets
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from dp_core import JOB_SECRET_VARIABLE, SET_JOB_SECRET, JobId
from jax_dp._processes import local
from jax_dp._processes.handshake import ANSWER_S, Lines, nonce_of, proof, seal, split

_MAX_CONNECTIONS = 64  # served at once; more are closed at once (a flood cannot exhaust threads)
_ACCEPT_S = 0.2  # how often the accepting thread looks whether it was closed


class _Joined(NamedTuple):
    connection: socket.socket
    lines: Lines
    nonces: tuple[bytes, bytes]


class Admission:
    """Process 0's listener on the coordinator's address: admits, then (kept) refuses latecomers."""

    def __init__(
        self, listener: socket.socket, address: str, num_processes: int, job: JobId, secret: bytes, generated: bool
    ) -> None:
        self.listener, self.address, self.num_processes, self.job = listener, address, num_processes, job
        self.secret, self.generated = secret, generated
        self.joined: dict[int, _Joined] = {}
        self.refused: list[str] = []
        self.conflict: str | None = None
        self.formed = False
        self.on_conflict: Callable[[str], None] | None = None  # once formed: how the job ends on one
        self.cleanups: list[Callable[[], None]] = []
        self._changed = threading.Condition()
        self._closed = threading.Event()
        self._slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
        self._thread = threading.Thread(target=self._accept, name="jax_dp-admission", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            if not self._slots.acquire(blocking=False):
                connection.close()
                continue
            threading.Thread(target=self._serve, args=(connection,), name="jax_dp-joiner", daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        kept = False
        try:
            kept = self._consider(connection)
        except Exception:  # anything a stranger sends (bytes, JSON, slowness) is ignored, whatever it raises
            pass
        finally:
            self._slots.release()
            if not kept:
                connection.close()

    def _consider(self, connection: socket.socket) -> bool:
        """One joiner: its hello, both proofs, then the answer; whether its connection is kept."""
        lines = Lines(connection, time.monotonic() + ANSWER_S)
        hello, line = lines.read()
        theirs, mine = nonce_of(hello), secrets.token_hex(16).encode()
        lines.send(
            {"answer": "prove", "nonce": mine.decode(), "proof": proof(self.secret, b"process 0", theirs, mine, line)}
        )
        reply, _ = lines.read()
        if not hmac.compare_digest(str(reply.get("proof")), proof(self.secret, b"process k", mine, theirs, line)):
            self._refuse(
                f"a process that does not hold this job's secret tried to join as process {hello.get('process_id')!r}: "
                f"it belongs to another job given the same coordinator address (give each job its own port), or "
                f"this job's processes were given different secrets (set the same {JOB_SECRET_VARIABLE} for all)"
            )
            return False
        nonces = (mine, theirs)
        with self._changed:
            kind, reason = self._decide(hello)
            answer: dict[str, Any] = {"answer": kind} if reason is None else {"answer": kind, "reason": reason}
            if kind == "started" and self.generated:
                answer["stops"] = True  # the job ends: this process may be the real one, whose place was taken
            lines.send(seal(self.secret, nonces, answer))
            if kind == "wait":
                self.joined[hello["process_id"]] = _Joined(connection, lines, nonces)
            self._changed.notify_all()
        if kind != "wait" and reason is not None:
            self._refuse(reason)
        if kind == "started" and self.generated and self.on_conflict is not None:
            self.on_conflict(reason or "")
        return kind == "wait"

    def _decide(self, hello: dict[str, Any]) -> tuple[str, str | None]:
        """``wait``, ``refused``, or ``started`` (too late), and why; a conflict where the secret
        was generated and a place is claimed twice."""
        process_id = hello.get("process_id")
        reason = _refusal(hello, self.num_processes, self.job)
        if reason is not None:
            return "refused", reason
        twice = self.generated and (self.formed or (process_id in self.joined and _still_open(self.joined[process_id])))
        if twice:
            self.conflict = (
                f"two processes claimed to be process {process_id} of the job at {self.address!r}, both with the "
                "secret process 0 generated for this user's jobs on that port: two jobs of this user were started "
                "on one port at once (or two processes were given one process_id), and process 0 cannot tell its "
                "own from the other's, so it stops the job rather than train with a stranger. Give each job its own "
                f"port, or each its own secret: {SET_JOB_SECRET}"
            )
        if self.formed:
            return "started", self.conflict or f"process {process_id} came after the job at {self.address!r} started"
        if twice:
            return "refused", self.conflict
        if process_id in self.joined:
            if _still_open(self.joined[process_id]):
                return "refused", (
                    f"process {process_id} already joined this job: give every process its own process_id (or this "
                    "process belongs to another job on the same coordinator address: give each job its own port)"
                )
            self.joined.pop(process_id).connection.close()  # the earlier one ended: this one takes its place
        return "wait", None

    def _refuse(self, reason: str) -> None:
        self.refused.append(reason)
        print(f"jax_dp: process 0 refused a process: {reason}", file=sys.stderr, flush=True)

    def wait(self, deadline: float, timeout: float) -> None:
        """Until every process joined (or a conflict, or ``deadline``: a clear error)."""
        with self._changed:
            while len(self.joined) < self.num_processes - 1 and self.conflict is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(1, self.num_processes)) - set(self.joined))
                    raise TimeoutError(
                        f"jax_dp process 0 waited {timeout:g} s (initialization_timeout) at {self.address!r} "
                        f"for processes {missing} of {self.num_processes}; none came"
                        + (f", and it refused: {'; '.join(self.refused)}" if self.refused else "")
                        + ". Start every process with the same coordinator address, num_processes and job id."
                    )
                self._changed.wait(min(remaining, 1.0))
            if self.conflict is not None:
                self._answer_all({"answer": "refused", "reason": self.conflict})
                raise RuntimeError(f"jax_dp process 0 stopped admitting processes: {self.conflict}.")
            self.formed = True

    def release(self, coordinator: str | None) -> None:
        """Tell every joined process to go on (to jax's coordinator at ``coordinator`` if given)."""
        self._answer_all({"answer": "ok", "coordinator": coordinator})

    def _answer_all(self, answer: dict[str, Any]) -> None:
        for joined in self.joined.values():
            with contextlib.suppress(OSError):  # it died meanwhile: jax's own start reports it
                joined.lines.deadline = time.monotonic() + ANSWER_S
                joined.lines.send(seal(self.secret, joined.nonces, answer))
            joined.connection.close()

    def close(self) -> None:
        """Stop listening (the port is free again), and remove what this job left in the user's folder."""
        self._closed.set()
        self.listener.close()
        self._thread.join(timeout=2 * _ACCEPT_S)
        for cleanup in self.cleanups:
            with contextlib.suppress(OSError):
                cleanup()
        self.cleanups.clear()


def admit(
    bind_address: str,
    coordinator_address: str,
    num_processes: int,
    job: JobId,
    timeout: float,
    secret: bytes | None,
    socket_path: str | None = None,
    coordinator: str | None = None,
) -> Admission:
    """Process 0: wait (at most ``timeout`` seconds) until every other process of the job joined,
    then tell them to go on to jax's coordinator: ``coordinator`` (another port, on several hosts),
    else the Unix socket at ``socket_path`` (one host; removed at ``close()``). The port stays held,
    refusing latecomers and strangers (a plain ``jax.distributed.initialize`` among them), until
    ``close()``; given neither, it is closed for jax's coordinator to take. ``secret`` ``None``:
    generate one for this user's processes (single host)."""
    deadline = time.monotonic() + timeout
    listener = _bind(bind_address, coordinator_address)
    cleanups: list[Callable[[], None]] = []
    try:
        generated = secret is None
        if secret is None:
            secret, path = local.create_secret(split(coordinator_address)[1])
            cleanups.append(_remover(path, secret))
        listener.listen(64)
        listener.settimeout(_ACCEPT_S)
        admission = Admission(listener, coordinator_address, num_processes, job, secret, generated)
    except BaseException:
        listener.close()
        for cleanup in cleanups:
            cleanup()
        raise
    admission.cleanups = cleanups
    try:
        admission.wait(deadline, timeout)
    except BaseException:
        admission.close()
        raise
    if socket_path is not None:
        admission.cleanups.append(functools.partial(_unlink, socket_path))
        coordinator = coordinator or f"unix:{socket_path}"
    if coordinator is None:
        admission.close()
    admission.release(coordinator)
    return admission


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _remover(path: Path, secret: bytes) -> Callable[[], None]:
    return lambda: local.remove_secret(path, secret)


def _refusal(hello: dict[str, Any], num_processes: int, job: JobId) -> str | None:
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
    if not isinstance(process_id, int) or isinstance(process_id, bool) or not 0 < process_id < num_processes:
        return (
            f"process_id={process_id!r} is not one of 1..{num_processes - 1}: process 0 runs the coordinator and "
            "every other process needs its own id below num_processes"
        )
    return None


def _still_open(joined: _Joined) -> bool:
    readable, _, _ = select.select([joined.connection], [], [], 0)
    if not readable:
        return True  # nothing to read, not closed
    try:
        return joined.connection.recv(1, socket.MSG_PEEK) != b""
    except OSError:
        return False


def _bind(bind_address: str, coordinator_address: str) -> socket.socket:
    """Process 0's socket on the coordinator's address: a busy port or another host's address is a
    clear error here, before jax (which only says "Failed to start RPC server", and can crash on exit)."""
    host, port = split(bind_address)
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
    except OSError as error:
        listener.close()
        if error.errno == errno.EADDRNOTAVAIL:
            raise RuntimeError(
                f"jax_dp could not start the coordinator at {coordinator_address!r}: {host} is not an address of "
                "this host, and process 0 runs the coordinator. Give every process process 0's own address."
            ) from None
        raise busy_port(coordinator_address) from None
    return listener


def free_port(host: str) -> int:
    """A port free now on ``host``'s address, for jax's coordinator (told only to admitted processes)."""
    family, kind, protocol, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, protocol) as probe:
        probe.bind(address)
        return int(probe.getsockname()[1])


def busy_port(coordinator_address: str) -> RuntimeError:
    return RuntimeError(
        f"jax_dp could not start the coordinator at {coordinator_address!r}: process 0 listens on that address "
        "and its port is in use (by another job, or another program) or not allowed. Pass a free port to every "
        "process, e.g. python -c 'import socket; s=socket.socket(); s.bind((\"\", 0)); print(s.getsockname()[1])' "
        "on process 0's host."
    )
