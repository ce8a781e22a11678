"""The pool's own folder under the temporary directory: a copy of the arrays, the model file, the
replicas' launcher and the rendezvous file, readable by this user only (0700).

Whether its owner lives is a property every job sharing the temporary directory can see, whatever
its pid namespace (two containers bind-mounting one ``/tmp``, a cluster's shared scratch): the
owner holds an advisory lock (``flock``) on the folder's lock file for its lifetime, which the
kernel releases when the owner dies, however it dies. A folder whose lock can be taken is stale.
Its name carries the owner's pid and an identity of its host and pid namespace, a second guard:
in this host and namespace a folder whose owner's pid still runs is kept even if its lock could
be taken (a file system whose locks this host does not see). A folder appears under its final
name with its lock already held (made under a hidden name, then renamed), so no job sees it unlocked.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import socket
import tempfile
import weakref

DIRECTORY_PREFIX = "torch_dp_"  # then the owner's pid, its host and namespace identity, a random part
LOCK_NAME = "owner.lock"


def identity() -> str:
    """This host and pid namespace, in 8 hex digits: a pid means a process only within them."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # not Linux: the host alone
        namespace = 0
    return hashlib.blake2b(f"{socket.gethostname()}/{namespace}".encode(), digest_size=4).hexdigest()


class PoolFolder:
    """A new folder in ``parent`` (the temporary directory by default), locked while this object
    lives; ``cleanup`` (or garbage collection, or the end of the interpreter) removes it."""

    def __init__(self, parent: str | None = None) -> None:
        parent = parent or tempfile.gettempdir()
        hidden = tempfile.mkdtemp(prefix=f".{DIRECTORY_PREFIX}{os.getpid()}_{identity()}_", dir=parent)
        self._lock = os.open(os.path.join(hidden, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        with contextlib.suppress(OSError):  # a file system without locks: others keep it (see _stale)
            fcntl.flock(self._lock, fcntl.LOCK_EX)
        self.name = os.path.join(parent, os.path.basename(hidden)[1:])
        try:
            os.rename(hidden, self.name)
        except OSError:
            _remove(hidden, self._lock)
            raise
        self._finalizer = weakref.finalize(self, _remove, self.name, self._lock)

    def intact(self) -> bool:
        """Whether the folder is still there with its lock file (nobody removed it meanwhile)."""
        try:
            on_disk, held = os.stat(os.path.join(self.name, LOCK_NAME)), os.fstat(self._lock)
        except OSError:
            return False
        return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)

    def cleanup(self) -> None:
        self._finalizer()


def _remove(path: str, lock: int) -> None:
    shutil.rmtree(path, ignore_errors=True)  # then let go of the lock: no one sees it half removed
    with contextlib.suppress(OSError):
        os.close(lock)


def remove_stale_directories(parent: str | None = None) -> list[str]:
    """Remove the replicas' folders that runs killed outright left: those of this user whose
    owner holds its lock no more (module docstring). Returns what was removed."""
    parent = parent or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            owner, _, rest = entry.name[len(DIRECTORY_PREFIX) :].partition("_")
            ours = entry.name.startswith(DIRECTORY_PREFIX) and owner.isdigit()
            if not ours or not entry.is_dir(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            if _remove_if_stale(entry.path, int(owner), rest.split("_", 1)[0]):
                removed.append(entry.path)
    return removed


def _remove_if_stale(path: str, owner: int, owner_identity: str) -> bool:
    """Remove the folder at ``path`` if its owner is gone; whether it did."""
    try:
        lock = os.open(os.path.join(path, LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:  # an older torch_dp's folder, with no lock: its pid alone tells
        if _alive(owner):
            return False
        shutil.rmtree(path, ignore_errors=True)
        return True
    except OSError:
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held (its owner lives), or a file system that cannot tell: kept
        os.close(lock)
        return False
    try:
        if owner_identity == identity() and _alive(owner):
            return False  # the lock did not hold it, yet its owner runs here: kept
        shutil.rmtree(path, ignore_errors=True)
        return True
    finally:
        os.close(lock)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists in this pid namespace."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process holds that pid now
        return True
    return True
