"""Writing a checkpoint (the format is ``dp_core._checkpoint_format``'s): under a temporary
name, every file flushed and fsynced, then renamed into place, so a reader sees a whole
checkpoint or none; older ones pruned after.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import stat
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from dp_core._checkpoint_format import (
    FILES,
    FORMAT_NAME,
    FORMAT_VERSION,
    GROUPS,
    JSON_LIMIT,
    NUMERIC_KINDS,
    Checkpoint,
    CheckpointVersionError,
    kind_of,
    sha256_of,
)
from dp_core._checkpoint_lock import verify_claim
from dp_core._checkpoint_read import list_checkpoints, newer_format_version
from dp_core._checkpoint_shards import PARTS_FORMAT_VERSION, Part, Parts, has_parts, is_parts, parts_file, write_parts


class PartsWritten(NamedTuple):
    """One process's parts file in a staged checkpoint: its name, hash, size and where each part lies."""

    file: str
    sha256: str
    size: int
    table: dict[str, list[list[Any]]]


# Checkpoints without parts are written as version 1, which dp-core 0.2.1 and later read.
WHOLE_FORMAT_VERSION = 1
# A .tmp-* staging directory nobody wrote to for this long was left by a killed writer.
_STALE_STAGING_SECONDS = 15 * 60


def save_checkpoint(directory: str | os.PathLike[str], checkpoint: Checkpoint, *, keep: int = 3) -> Path:
    """Write ``checkpoint`` atomically under ``directory``; keep the newest ``keep`` (and always this one).

    A write that fails (a full disk) removes its partial files and raises an ``OSError`` saying
    so; the checkpoints written before are untouched. Staging directories left by killed
    writers are removed once nobody has written to them for 15 minutes.
    """
    root, staging = _staged(directory)
    final = root / checkpoint.name
    with _committing(root, staging, final, keep):
        arrays = _arrays_of(checkpoint)
        if has_parts(checkpoint):
            _write_parts_files(staging, checkpoint, arrays)
        else:
            _write_files(staging, checkpoint, arrays)
    return final


def _staged(directory: str | os.PathLike[str]) -> tuple[Path, Path]:
    """The checkpoint folder (made, still held where this process holds it) and a new staging folder in it."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    verify_claim(root)  # where this process holds the folder, it still does
    _remove_stale_staging(root)
    return root, Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))


def _arrays_of(checkpoint: Checkpoint) -> dict[str, Any]:
    return {
        f"{group}/{i}": value if is_parts(value) else _plain_array(group, i, value)
        for group in GROUPS
        for i, value in enumerate(getattr(checkpoint, group))
    }


@contextlib.contextmanager
def _committing(root: Path, staging: Path, final: Path, keep: int) -> Iterator[None]:
    """The block writes ``staging``; then it is renamed to ``final`` and the oldest beyond ``keep`` go.
    A write that fails removes the staging folder; a full disk says so."""
    try:
        yield
        _put_in_place(staging, final)
        _fsync_directory(root)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        full = error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
        hint = " Free disk space, or point checkpoint_dir at another disk." if full else ""
        raise OSError(
            error.errno,
            f"Could not write checkpoint {final.name} in {root}: {error.strerror or error}. The partial checkpoint "
            f"was removed; the checkpoints written before are intact.{hint}",
        ) from error
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        # a checkpoint named later than this one (say, damaged, skipped) never evicts it, and one
        # of a newer format is never removed by a version that cannot read it
        if old != final and newer_format_version(old) is None:
            _remove(old)


def stage_checkpoint(directory: str | os.PathLike[str]) -> Path:
    """A checkpoint written by several processes, each its own parts (format version 2): the primary
    stages a folder in ``directory`` (returned), every other process writes its parts there
    (``write_process_parts``), and the primary commits it (``commit_checkpoint``) with their records."""
    return _staged(directory)[1]


def write_process_parts(staging: str | os.PathLike[str], process: int, arrays: dict[str, Any]) -> PartsWritten:
    """``process``'s parts (each array a ``Parts``, by ``"<group>/<index>"``) into the staged folder,
    flushed to disk; its record goes to the primary for the manifest."""
    folder, file = Path(staging), parts_file(process)
    table = write_parts(folder / file, arrays, file)
    with open(folder / file, "rb+") as f:
        os.fsync(f.fileno())
    return PartsWritten(file, _sha256(folder / file), os.stat(folder / file).st_size, table)


def commit_checkpoint(
    directory: str | os.PathLike[str],
    staging: str | os.PathLike[str],
    checkpoint: Checkpoint,
    others: Sequence[PartsWritten],
    *,
    keep: int = 3,
) -> Path:
    """The staged checkpoint written whole: the primary's own parts (``checkpoint``'s arrays, each a
    ``Parts`` or whole) and the manifest over every process's (``others``' records), then renamed into
    place as ``save_checkpoint`` does. Every array must be in ``checkpoint``, with its shape and dtype."""
    root, folder = Path(directory), Path(staging)
    final = root / checkpoint.name
    with _committing(root, folder, final, keep):
        _write_parts_files(folder, checkpoint, _arrays_of(checkpoint), others=others)
    return final


def _remove(checkpoint: Path) -> None:
    """Remove an old checkpoint whole: renamed out of the listing first, so a writer killed while
    deleting its files (a background write when a process dies) leaves a ``.tmp-*`` directory,
    never a ``step-*`` one with files missing."""
    aside = checkpoint.parent / f".tmp-pruned-{uuid.uuid4().hex[:8]}"
    try:
        os.replace(checkpoint, aside)
    except OSError:  # pruned meanwhile by another writer, or not ours to remove
        return
    shutil.rmtree(aside, ignore_errors=True)


def _plain_array(group: str, index: int, value: Any) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype == object:
        raise TypeError(f"{group}[{index}] is an object array, which would need pickle; checkpoints hold numbers only.")
    if array.dtype.kind not in NUMERIC_KINDS:
        raise TypeError(
            f"{group}[{index}] has dtype {array.dtype}, which .npy files do not keep as numbers (it would come back "
            "as raw bytes); checkpoints hold bool, integer, float and complex arrays only."
        )
    return array


def _write_files(staging: Path, checkpoint: Checkpoint, arrays: dict[str, Any]) -> None:
    with open(staging / "arrays.npz", "wb") as f:
        np.savez(f, **arrays)  # stored, not compressed: the reader refuses compressed members
        f.flush()
        os.fsync(f.fileno())
    _write_state(staging, checkpoint)
    manifest = {
        "format": FORMAT_NAME,
        "format_version": WHOLE_FORMAT_VERSION,
        "files": {name: _sha256(staging / name) for name in FILES},
        # added after dp-core 0.2.1, whose reader ignores them; this reader does without them
        "sizes": {name: os.stat(staging / name).st_size for name in FILES},
        "arrays": {
            key: {"dtype": np.lib.format.dtype_to_descr(array.dtype), "shape": list(array.shape)}
            for key, array in arrays.items()
        },
    }
    _write_text(staging / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True))


def _write_state(staging: Path, checkpoint: Checkpoint) -> None:
    fields = {key: value for key, value in vars(checkpoint).items() if key not in GROUPS}
    state = asdict(Checkpoint(**fields, weights=[]))  # the arrays (parts too) are not copied
    state = {key: value for key, value in state.items() if key not in GROUPS}
    state["counts"] = {group: len(getattr(checkpoint, group)) for group in GROUPS}
    _write_text(staging / "state.json", json.dumps(state, indent=1, sort_keys=True))


def _write_parts_files(
    staging: Path, checkpoint: Checkpoint, arrays: dict[str, Any], *, others: Sequence[PartsWritten] = ()
) -> None:
    """Format version 2 (``dp_core._checkpoint_shards``): this process's parts in ``parts-0.npz`` (a whole
    array as one part), the other processes' already written (``others``), the manifest listing where
    each part lies."""
    as_parts = {key: _as_parts(value) for key, value in arrays.items()}
    own = write_process_parts(staging, 0, as_parts)
    _write_state(staging, checkpoint)
    written = [own, *others]
    table = {key: [entry for record in written for entry in record.table.get(key, [])] for key in as_parts}
    hashes = {"state.json": _sha256(staging / "state.json"), **{record.file: record.sha256 for record in written}}
    sizes = {"state.json": os.stat(staging / "state.json").st_size, **{record.file: record.size for record in written}}
    manifest = {
        "format": FORMAT_NAME,
        "format_version": PARTS_FORMAT_VERSION,
        "files": hashes,
        "sizes": sizes,
        "arrays": {
            key: {"dtype": np.lib.format.dtype_to_descr(np.dtype(array.dtype)), "shape": list(array.shape)}
            for key, array in as_parts.items()
        },
        "parts": table,
    }
    _write_text(staging / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True))


def _as_parts(value: Any) -> Any:
    if is_parts(value):
        return value
    return Parts(tuple(value.shape), value.dtype, [Part((0,) * value.ndim, value)])


def _put_in_place(staging: Path, final: Path) -> None:
    """Rename the written ``staging`` to ``final``. The same step written again (a resumed run)
    replaces the old one whole: swapped in one step where the kernel can (``renameat2``), so a
    reader never finds the name missing, else moved aside first."""
    try:
        mode = os.lstat(final).st_mode
    except FileNotFoundError:
        os.replace(staging, final)
        return
    if not stat.S_ISDIR(mode):  # the entry itself goes, never what a symlink points to
        warnings.warn(f"Replacing {final}: it was {kind_of(mode)}, not a checkpoint directory.", stacklevel=3)
        os.unlink(final)
        os.replace(staging, final)
        return
    newer = newer_format_version(final)
    if newer is not None:
        raise CheckpointVersionError(
            f"Not writing {final}: a checkpoint of format version {newer} (a newer keras-dp's) has that name, and "
            f"this version writes version {FORMAT_VERSION}. Point checkpoint_dir at another folder.",
            path=str(final),
            version=newer,
        )
    if not _exchange(staging, final):
        aside = final.parent / f".tmp-replaced-{uuid.uuid4().hex[:8]}"
        os.replace(final, aside)
        os.replace(staging, final)
        staging = aside
    shutil.rmtree(staging, ignore_errors=True)  # now the old checkpoint


def _exchange(first: Path, second: Path) -> bool:
    """Swap two directory entries atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where
    the platform or filesystem cannot."""
    renameat2 = getattr(_LIBC, "renameat2", None) if _LIBC is not None else None
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV, errno.EPERM):
        return False
    raise OSError(code, os.strerror(code), str(second))


try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except (OSError, TypeError):  # no C library to ask (Windows)
    _LIBC = None


def _remove_stale_staging(root: Path) -> None:
    """``.tmp-*`` directories of killed writers. Only the primary process writes, but another run
    may be writing into the same directory now: a staging directory is removed only once nothing
    in it changed for ``_STALE_STAGING_SECONDS``. Readers never remove anything."""
    now = time.time()
    with os.scandir(root) as entries:
        staging = [e.path for e in entries if e.name.startswith(".tmp-") and e.is_dir(follow_symlinks=False)]
    for path in staging:
        try:
            with os.scandir(path) as files:
                changed = max([os.lstat(path).st_mtime, *(f.stat(follow_symlinks=False).st_mtime for f in files)])
        except OSError:  # removed meanwhile
            continue
        if now - changed > _STALE_STAGING_SECONDS:
            shutil.rmtree(path, ignore_errors=True)


def _write_text(path: Path, text: str) -> None:
    data = text.encode()
    if len(data) > JSON_LIMIT:
        raise ValueError(
            f"{path.name} would take {len(data)} bytes, over the {JSON_LIMIT} a reader accepts; "
            "keep extra (the History) smaller."
        )
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_directory(path: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return sha256_of(f)
