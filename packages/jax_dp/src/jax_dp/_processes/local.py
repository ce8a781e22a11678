"""What only this user can reach on one host: a folder of the user's own (0700), the secret
process 0 generates there for a single-host job without ``KERAS_DP_JOB_SECRET`` (a 0600 file
keyed by the coordinator's port), and the Unix socket jax's coordinator listens on there.

Another user can neither read the secret nor reach the socket. Two jobs of the same user on one
port at once would share the file: process 0 holds the port for the job's whole life, so a
second process 0 fails at once, and a place claimed twice ends the job (``admission``), rather
than two jobs silently training together.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import socket
import stat
import tempfile
from pathlib import Path

_MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux, 104 on macOS


def is_loopback(host: str) -> bool:
    """Whether ``host`` can only mean this host (``127.0.0.1``, ``::1``, ``localhost``)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        found = {str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except socket.gaierror:
        return False
    return bool(found) and all(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in found)


def user_folder() -> Path:
    """``<temp>/keras-dp-<uid>``, created 0700 if absent; refused if someone else made it or others can enter it."""
    folder = Path(tempfile.gettempdir()) / f"keras-dp-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    found = os.lstat(folder)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
        raise RuntimeError(
            f"jax_dp keeps a single-host job's secret in {folder}, but that is not a folder only this user "
            f"(uid {os.getuid()}) can enter (owner uid {found.st_uid}, mode {stat.filemode(found.st_mode)}): "
            "another user may have made it to read your jobs' secrets. Remove it, or set KERAS_DP_JOB_SECRET "
            "for the job."
        )
    return folder


def secret_path(port: int) -> Path:
    return user_folder() / f"jax-{port}.secret"


def create_secret(port: int) -> tuple[bytes, Path]:
    """Process 0, holding ``port``: a new secret in a 0600 file for its joiners (any file there
    is a dead job's, since the port is ours: it is replaced whole, never seen half-written). The
    files killed jobs left for other ports (their process 0 no longer runs) are removed."""
    secret, path = secrets.token_hex(32).encode(), secret_path(port)
    for left in path.parent.glob("jax-*.secret"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            if not _running(int(json.loads(left.read_text())["pid"])):
                left.unlink()
    draft = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    descriptor = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w") as file:
        json.dump({"secret": secret.decode(), "pid": os.getpid()}, file)
    os.replace(draft, path)
    return secret, path


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal sent: whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_secret(port: int) -> bytes | None:
    """A joiner: the secret process 0 of this user's job on ``port`` wrote, or ``None``."""
    try:
        descriptor = os.open(secret_path(port), os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    with os.fdopen(descriptor) as file:
        found = os.fstat(file.fileno())
        if found.st_uid != os.getuid() or found.st_mode & 0o077:
            return None  # not written by process 0 of this user's job: no secret to trust
        try:
            return str(json.load(file)["secret"]).encode()
        except (ValueError, KeyError, TypeError):
            return None


def remove_secret(path: Path, secret: bytes) -> None:
    """Remove ``path`` if it still holds ``secret`` (a later job's process 0 may have replaced it)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        if str(json.loads(path.read_text())["secret"]).encode() == secret:
            path.unlink()


def socket_path(port: int) -> str | None:
    """A new path for jax's coordinator in the user's folder, or ``None`` where it would be too
    long for a Unix socket (a deep TMPDIR): jax's coordinator then listens on TCP. Sockets that
    killed jobs left there (nothing listens on them any more) are removed."""
    folder = user_folder()
    for left in folder.glob("jax-*.sock"):
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as probe:
            try:
                probe.connect(str(left))
            except ConnectionRefusedError:
                left.unlink()
    path = str(folder / f"jax-{port}-{secrets.token_hex(4)}.sock")
    return path if len(path.encode()) <= _MAX_SOCKET_PATH else None
