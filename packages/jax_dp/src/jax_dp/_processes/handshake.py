"""Before jax's coordinator starts, process 0 admits its own job's processes, each once
(``admission``); this module is the protocol both sides speak, and the joiner's side.

jax's coordination service checks nobody: a process of another job that connects as task k
aborts the running job. So process 0 first listens on the coordinator's address itself and
admits, for every process id 1..N-1, one process that proves it holds the job's secret and
brings the same job id and the same N; only then does jax's service start (on a Unix socket
only this user can reach, for a single-host job; else on the port, once process 0 closed it).

Each message is one line of at most ``MAX_LINE`` bytes: the protocol's tag, then JSON.

1. joiner: its ``process_id``, ``num_processes``, job id and a fresh nonce (the *hello*);
2. process 0: ``prove`` with a fresh nonce of its own and its proof, an HMAC-SHA256 of both
   nonces and the hello under the job's secret;
3. joiner: checks that proof (a process 0 without the secret is not its job's), sends its own
   (the same HMAC under another label, so neither a replayed nor a reflected proof passes);
4. process 0: ``wait`` at once, then ``ok`` (with the coordinator's address for jax) once every
   process is there, or ``refused`` with the reason: each answer sealed by an HMAC as well.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import secrets
import socket
import time
from typing import Any

from dp_core import JOB_SECRET_VARIABLE, JobId
from jax_dp._processes import local

TAG = b"jax_dp-handshake/2 "
ANSWER_S = 5.0  # process 0 answers a joiner at once: silence or anything else means no handshake there
MAX_LINE = 1024  # every message of the protocol fits; a longer line is not one
_RETRY_S = 0.25  # between a joiner's attempts to connect while process 0 is not listening yet


class NotHandshakeError(ValueError):
    """What came is not this protocol (a port scan, jax's gRPC server, a stranger's bytes)."""


def proof(secret: bytes, label: bytes, *parts: bytes) -> str:
    """HMAC-SHA256 under ``secret`` of ``label`` and ``parts`` (each length-prefixed)."""
    digest = hmac.new(secret, label, hashlib.sha256)
    for part in parts:
        digest.update(len(part).to_bytes(4, "big") + part)
    return digest.hexdigest()


def seal(secret: bytes, nonces: tuple[bytes, bytes], answer: dict[str, Any]) -> dict[str, Any]:
    """Process 0's ``answer`` with its HMAC over both nonces (nobody else can forge one)."""
    return {**answer, "seal": proof(secret, b"jax_dp answer", *nonces, _canonical(answer))}


def opened(secret: bytes, nonces: tuple[bytes, bytes], message: dict[str, Any]) -> dict[str, Any] | None:
    """``message`` without its seal if process 0 sealed it, else ``None``."""
    answer = {key: value for key, value in message.items() if key != "seal"}
    expected = proof(secret, b"jax_dp answer", *nonces, _canonical(answer))
    return answer if hmac.compare_digest(str(message.get("seal")), expected) else None


def _canonical(message: dict[str, Any]) -> bytes:
    return json.dumps(message, sort_keys=True).encode()


def nonce_of(message: dict[str, Any]) -> bytes:
    nonce = message.get("nonce")
    if not isinstance(nonce, str) or not 32 <= len(nonce) <= 128:
        raise NotHandshakeError("no nonce")
    return nonce.encode()


class Lines:
    """The messages on one connection, each bounded by ``MAX_LINE`` bytes and all by ``deadline``
    (``time.monotonic()``): a stranger's bytes end in ``NotHandshakeError`` or ``TimeoutError``, never
    in anything else, and never later than the deadline however slowly they come."""

    def __init__(self, connection: socket.socket, deadline: float) -> None:
        self.connection, self.deadline, self.received = connection, deadline, b""

    def read(self) -> tuple[dict[str, Any], bytes]:
        """The next message, and its line as sent."""
        while b"\n" not in self.received:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no whole message in time")
            self.connection.settimeout(remaining)
            chunk = self.connection.recv(MAX_LINE)
            if not chunk:
                raise NotHandshakeError("closed before a whole message")
            self.received += chunk
            if self.received[: len(TAG)] != TAG[: len(self.received)] or len(self.received.split(b"\n")[0]) > MAX_LINE:
                raise NotHandshakeError("not a jax_dp handshake")
        line, _, self.received = self.received.partition(b"\n")
        try:
            message = json.loads(line[len(TAG) :])
        except (ValueError, RecursionError) as error:  # '[' * 3000 recurses in json
            raise NotHandshakeError("not JSON") from error
        if not isinstance(message, dict):
            raise NotHandshakeError("not a jax_dp handshake")
        return message, line

    def send(self, message: dict[str, Any]) -> None:
        remaining = self.deadline - time.monotonic()
        self.connection.settimeout(max(remaining, 0.1))
        self.connection.sendall(TAG + json.dumps(message).encode() + b"\n")


def join(
    coordinator_address: str, process_id: int, num_processes: int, job: JobId, timeout: float, secret: bytes | None
) -> str | None:
    """Process ``process_id`` > 0: be admitted by process 0 (within ``timeout`` seconds) before
    calling jax. ``secret`` ``None``: the one process 0 generated for this user on one host.
    Returns the address jax's coordinator listens on when it is not ``coordinator_address``."""
    deadline = time.monotonic() + timeout
    connection = _connect(coordinator_address, deadline, timeout)
    mine = secrets.token_hex(16).encode()
    hello = {"process_id": process_id, "num_processes": num_processes, "job": job.value, "job_source": job.source}
    hello["nonce"] = mine.decode()
    with connection:
        lines = Lines(connection, time.monotonic() + ANSWER_S)
        try:
            lines.send(hello)
            challenge, _ = lines.read()
            theirs = nonce_of(challenge)
        except (OSError, ValueError):
            raise _not_process_0(coordinator_address, process_id) from None
        line = TAG + json.dumps(hello).encode()  # as sent: both proofs cover it
        secret = secret if secret is not None else _generated(coordinator_address, process_id)
        if not hmac.compare_digest(str(challenge.get("proof")), proof(secret, b"process 0", mine, theirs, line)):
            with contextlib.suppress(OSError):  # so that process 0's log says who did not join
                lines.send({"proof": None})
            raise RuntimeError(
                f"jax_dp process {process_id}: the process 0 listening at {coordinator_address!r} does not hold this "
                f"job's secret, so this process did not join it: it is another job's process 0 on the same address "
                f"(give each job its own port), or this job's processes were given different secrets (set the same "
                f"{JOB_SECRET_VARIABLE} for every process of the job, or none of them on one host)."
            )
        answer = _answers(lines, secret, (theirs, mine), proof(secret, b"process k", theirs, mine, line))
        if answer.get("answer") == "wait":
            lines.deadline = deadline
            answer = _waited(lines, secret, (theirs, mine), coordinator_address, process_id, num_processes, timeout)
    if answer.get("answer") == "started" and answer.get("stops"):
        raise RuntimeError(
            f"jax_dp process {process_id} came after the job at {coordinator_address!r} started, and process 0 "
            f"stops that job now: {answer.get('reason')}."
        )
    if answer.get("answer") == "started":
        raise _not_process_0(coordinator_address, process_id)
    if answer.get("answer") != "ok":
        raise RuntimeError(
            f"jax_dp process {process_id} was refused by process 0 at {coordinator_address!r}: "
            f"{answer.get('reason', answer)}."
        )
    coordinator = answer.get("coordinator")
    return coordinator if isinstance(coordinator, str) else None


def _answers(lines: Lines, secret: bytes, nonces: tuple[bytes, bytes], mine: str) -> dict[str, Any]:
    """Send this process's proof; process 0's sealed answer to it."""
    try:
        lines.send({"proof": mine})
        answer = opened(secret, nonces, lines.read()[0])
    except (OSError, ValueError):
        answer = None
    if answer is None:
        raise RuntimeError(
            "jax_dp: process 0 gave no sealed answer to this process's proof of the job's secret: it ended, or it "
            "is not this job's process 0; see its log."
        )
    return answer


def _waited(
    lines: Lines,
    secret: bytes,
    nonces: tuple[bytes, bytes],
    coordinator_address: str,
    process_id: int,
    num_processes: int,
    timeout: float,
) -> dict[str, Any]:
    try:
        answer = opened(secret, nonces, lines.read()[0])
    except TimeoutError:
        raise TimeoutError(
            f"jax_dp process {process_id} joined process 0 at {coordinator_address!r} but not every one of the "
            f"{num_processes} processes came within {timeout:g} s (initialization_timeout). Start them all."
        ) from None
    except (OSError, ValueError):
        answer = None
    if answer is None:
        raise RuntimeError(
            f"jax_dp process {process_id}: process 0 at {coordinator_address!r} ended while waiting for the "
            "other processes; see its log."
        )
    return answer


def _generated(coordinator_address: str, process_id: int) -> bytes:
    port = split(coordinator_address)[1]
    secret = local.read_secret(port)
    if secret is None:
        raise RuntimeError(
            f"jax_dp process {process_id} found a process 0 at {coordinator_address!r} but no secret of this "
            f"user's job there ({local.secret_path(port)}, which process 0 of a single-host job writes when "
            f"{JOB_SECRET_VARIABLE} is not set): that process 0 belongs to another user, or it was started with "
            f"{JOB_SECRET_VARIABLE} (set the same one for this process), so this process did not join it."
        )
    return secret


def _not_process_0(coordinator_address: str, process_id: int) -> RuntimeError:
    return RuntimeError(
        f"jax_dp process {process_id}: the coordinator address {coordinator_address!r} is held by a job that "
        "already started (or by another program): it did not answer as a jax_dp process 0 waiting for its "
        "processes does, so this process did not join it. Give this job its own port (and check that "
        "num_processes counts every process of the job)."
    )


def _connect(coordinator_address: str, deadline: float, timeout: float) -> socket.socket:
    """A connection to process 0, retried while it does not listen yet."""
    host, port = split(coordinator_address)
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


def joined(host: str, port: int) -> str:
    """``host:port`` (an IPv6 host in brackets): ``split``'s inverse."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"A coordinator address is 'host:port', e.g. '10.0.0.1:1234'; got {address!r}.")
    return host.strip("[]"), int(port)
