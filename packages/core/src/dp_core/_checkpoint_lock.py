"""One writer per checkpoint folder: ``checkpoint_dir`` checked before a fit starts, and held
by the writing process for the whole fit.

Two runs writing one folder would prune each other's checkpoints and resume from them. The
writer (rank 0 / process 0) holds an exclusive ``flock`` on ``<checkpoint_dir>/.keras-dp.lock``,
which the kernel releases when the process dies, however it dies; a second writer is refused at
once, naming the holder. The lock file also records the holder (host, pid, a random token): where
``flock`` does not reach across hosts (NFS mounted ``nolock``, some FUSE filesystems), a run whose
record was overwritten by another notices before its next write (``verify_claim``) and stops,
instead of pruning the other's checkpoints.

Process-global state: ``_HELD``, the folders this process holds, by real path, each with the
thread that claimed it and how many times (a claim is re-entrant within one thread only).
Invariant: a folder is in ``_HELD`` exactly while this process holds its flock and its record.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dp_core._checkpoint_format import CheckpointError, kind_of

try:
    import fcntl
except ImportError:  # not POSIX: the record is the only guard
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".keras-dp.lock"
_RECORD_LIMIT = 64 << 10
_ATTEMPTS = 5  # a claim's tries, 10 ms apart, before another holder is believed


class CheckpointDirError(CheckpointError):
    """``checkpoint_dir`` cannot be used: not a folder, not writable, or held by another run."""


class CheckpointDirInUseError(CheckpointDirError):
    """Another run (``host``, ``pid``) holds ``checkpoint_dir``'s lock."""

    def __init__(self, message: str, *, host: str | None, pid: int | None) -> None:
        super().__init__(message)
        self.host, self.pid = host, pid


@dataclass
class _Claim:
    root: Path
    fd: int
    token: str
    thread: int
    depth: int = 1


_HELD: dict[str, _Claim] = {}
_HELD_LOCK = threading.Lock()


def check_checkpoint_dir(directory: str | os.PathLike[str]) -> Path:
    """``directory`` as a ``Path`` once it is known that a checkpoint can be written there: it
    is a folder, or one can be made (no part of the path is a file), a file can be created in
    it, and no other run holds it (``CheckpointDirInUseError``). The probe creates and removes a
    file, so it answers for this process's user whatever ``os.access`` says (root, ACLs,
    read-only mounts); nothing is left behind. A ``CheckpointDirError`` names the path and the
    reason. ``claim_checkpoint_dir`` checks it again, and holds it."""
    path = Path(os.path.abspath(os.fspath(directory)))
    existing = existing_folder_of(path)
    shown = f"{str(directory)!r} is not writable" if existing == path else f"{str(directory)!r} cannot be created"
    probe = existing / f".keras-dp-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as error:
        raise CheckpointDirError(
            f"checkpoint_dir {shown}: creating a file in {existing} failed ({error.strerror or error}) for user "
            f"{_user()}. Make the folder writable for that user, or point checkpoint_dir at a folder it can write."
        ) from error
    os.close(fd)
    os.unlink(probe)
    if existing == path:
        _refuse_if_held(path)
    return path


def _refuse_if_held(root: Path) -> None:
    """A ``CheckpointDirInUseError`` when another process, or another thread here, holds ``root``.
    Asked with a shared lock released at once, so nothing is held after; a claim made meanwhile
    retries past it (``_lock``)."""
    held = _HELD.get(os.path.realpath(root))
    if held is not None:
        if held.thread != threading.get_ident():
            raise _in_use(root, _read_record(root), "another thread of this process")
        return
    if fcntl is None:
        return
    try:
        fd = os.open(root / LOCK_NAME, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # none yet (or not a file: the claim says so)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(root, _wait_for_record(root), "another run") from None
    except OSError:
        pass  # no locks on this filesystem: the claim warns
    finally:
        os.close(fd)


def existing_folder_of(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists, which must be a folder."""
    for candidate in (path, *path.parents):
        try:
            mode = os.stat(candidate).st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as error:
            raise CheckpointDirError(
                f"checkpoint_dir {str(path)!r} cannot be used: {candidate} cannot be read ({error.strerror or error})."
            ) from error
        if not stat.S_ISDIR(mode):
            where = "it is" if candidate == path else f"{candidate} is"
            raise CheckpointDirError(
                f"checkpoint_dir {str(path)!r} is not a folder: {where} {kind_of(mode)}, not a directory. Point "
                "checkpoint_dir at a folder (it is created if missing)."
            )
        return candidate
    return Path(path.anchor)


@contextmanager
def claim_checkpoint_dir(directory: str | os.PathLike[str]) -> Iterator[Path]:
    """Hold ``directory`` for one writer, made if missing, until the block ends (also on error;
    the kernel releases it if the process dies). Another holder is a ``CheckpointDirInUseError``
    naming its host and pid; the same thread may claim a folder it holds again.

    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> with claim_checkpoint_dir(folder) as root:  # a writer would save_checkpoint(root, ...) here
    ...     os.listdir(root), json.loads((root / LOCK_NAME).read_text())["pid"] == os.getpid()
    (['.keras-dp.lock'], True)
    >>> (Path(folder) / LOCK_NAME).read_text()  # released
    ''
    """
    claim = _acquire(check_checkpoint_dir(directory))
    try:
        yield claim.root
    finally:
        _release(claim)


def _acquire(root: Path) -> _Claim:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        reason = error.strerror or error
        raise CheckpointDirError(f"checkpoint_dir {str(root)!r} cannot be created: {reason}.") from error
    key = os.path.realpath(root)
    with _HELD_LOCK:
        held = _HELD.get(key)
        if held is not None and held.thread == threading.get_ident():
            held.depth += 1
            return held
        if held is not None:
            raise _in_use(root, _read_record(root), "another thread of this process")
        fd = _open_lock_file(root)
        claim = _Claim(root, fd, uuid.uuid4().hex, threading.get_ident())
        try:
            _lock(fd, root)
            _warn_if_unreleased(root, _read_record(root))
            _write_record(fd, _record_of(claim.token))
        except OSError as error:  # the record cannot be written (a full disk): neither is a checkpoint
            os.close(fd)
            raise CheckpointDirError(
                f"checkpoint_dir {str(root)!r}: its lock file cannot be written ({error.strerror or error})."
            ) from error
        except BaseException:
            os.close(fd)
            raise
        _HELD[key] = claim
        return claim


def _release(claim: _Claim) -> None:
    with _HELD_LOCK:
        claim.depth -= 1
        if claim.depth > 0:
            return
        _HELD.pop(os.path.realpath(claim.root), None)
        try:
            if _read_record(claim.root).get("token") == claim.token:  # released: an empty record
                os.ftruncate(claim.fd, 0)
        except OSError:
            pass  # the folder went away: nothing left to release but the lock
        finally:
            os.close(claim.fd)  # releases the flock


def verify_claim(directory: str | os.PathLike[str]) -> None:
    """Before a write into a folder this process claimed: the record still names this run. Where
    locks do not reach another host, a second run overwrote it; this one stops before it writes
    or prunes anything. Folders this process did not claim are not checked."""
    claim = _HELD.get(os.path.realpath(directory))
    if claim is None:
        return
    record = _read_record(claim.root)
    if record.get("token") != claim.token:
        raise _in_use(
            claim.root,
            record,
            "a run that took the folder over while this one held it (its filesystem does not share locks "
            "between hosts); this run stops writing checkpoints there so the two do not prune each other's",
        )


def _open_lock_file(root: Path) -> int:
    path = root / LOCK_NAME
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags, 0o644)
    except PermissionError as error:  # someone else's lock file, say another user's run
        record = _read_record(root)
        if record:
            raise _in_use(root, record, "a run whose lock file this user cannot write") from error
        raise CheckpointDirError(
            f"checkpoint_dir {str(root)!r}: its lock file {path} cannot be opened ({error.strerror}) for user "
            f"{_user()}. Point checkpoint_dir at a folder of this user's, or remove the lock file."
        ) from error
    except OSError as error:
        kind = ""
        with suppress(OSError):
            kind = f" it is {kind_of(os.lstat(path).st_mode)};"
        raise CheckpointDirError(
            f"checkpoint_dir {str(root)!r}: its lock file {path} cannot be opened ({error.strerror or error});{kind} "
            "remove it, or point checkpoint_dir at another folder."
        ) from error


def _lock(fd: int, root: Path) -> None:
    if fcntl is None:
        return
    for attempt in range(_ATTEMPTS):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if attempt == _ATTEMPTS - 1:
                raise _in_use(root, _wait_for_record(root), "another run") from None
            time.sleep(0.01)  # a check's shared lock lasts microseconds
        except OSError as error:  # a filesystem without flock (ENOLCK, EINVAL): the record still guards
            warnings.warn(
                f"checkpoint_dir {str(root)!r}: its filesystem refuses file locks ({error.strerror or error}), so "
                "only the lock file's record keeps a second run from writing there, at that run's next checkpoint.",
                stacklevel=4,
            )
            return


def _wait_for_record(root: Path) -> dict[str, Any]:
    record: dict[str, Any] = {}
    for _ in range(20):  # the holder writes its record just after it locks
        record = _read_record(root)
        if record:
            break
        time.sleep(0.01)
    return record


def _in_use(root: Path, record: dict[str, Any], who: str) -> CheckpointDirInUseError:
    host, pid = record.get("host"), record.get("pid")
    host = host if isinstance(host, str) else None
    pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else None
    if host is not None and pid is not None:
        since, program = record.get("since"), record.get("program")
        holder = f"process {pid} on host {host!r}" + (f", running {program!r}" if isinstance(program, str) else "")
        holder += f", since {since}" if isinstance(since, str) else ""
        stop = f" (or stop it: `kill {pid}` on {host})"
    else:
        holder, stop = "a process that has not recorded itself yet", ""
    return CheckpointDirInUseError(
        f"checkpoint_dir {str(root)!r} is in use by {who}: {holder} holds {root / LOCK_NAME}. Two runs writing "
        "one folder would prune and resume from each other's checkpoints. Point this run at another "
        f"checkpoint_dir, or wait for that run to end{stop} and start this one again.",
        host=host,
        pid=pid,
    )


def _record_of(token: str) -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "token": token,
        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "program": " ".join(sys.argv)[:200] or sys.executable,
    }


def _write_record(fd: int, record: dict[str, Any]) -> None:
    data = json.dumps(record, sort_keys=True).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _read_record(root: Path) -> dict[str, Any]:
    """The lock file's record; empty when released, missing or unreadable."""
    try:
        fd = os.open(root / LOCK_NAME, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return {}
    try:
        data = os.read(fd, _RECORD_LIMIT)
    except OSError:
        return {}
    finally:
        os.close(fd)
    try:
        record = json.loads(data) if data else {}
    except (ValueError, RecursionError):
        return {}
    return record if isinstance(record, dict) else {}


def _warn_if_unreleased(root: Path, previous: dict[str, Any]) -> None:
    """A record left by a holder on another host: it ended without releasing (killed, host
    lost), or this filesystem's locks do not reach across hosts and it still runs."""
    host = previous.get("host")
    if not isinstance(host, str) or host == socket.gethostname():
        return  # on one host flock is exact: a record left here is a dead process's
    warnings.warn(
        f"checkpoint_dir {str(root)!r} was held by process {previous.get('pid')} on host {host!r}, which did not "
        "release it: it ended without cleaning up (killed, host lost), or this filesystem does not share locks "
        "between hosts and it still runs. If it still runs, stop this run: the two would prune each other's "
        "checkpoints (that run stops at its next checkpoint).",
        stacklevel=4,
    )


def _user() -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(os.getuid()).pw_name!r} (uid {os.getuid()})"
    except (ImportError, KeyError, AttributeError):
        return f"uid {getattr(os, 'getuid', lambda: '?')()}"
