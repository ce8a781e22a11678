"""Reading checkpoints: listing them, loading one, the newest that verifies.

Reading assumes the directory may have been damaged or crafted, checksums resealed included:
only regular files are opened (never through a symlink, never a FIFO or device), every size is
checked before anything is read or allocated (JSON files are capped, array members are stored
uncompressed and must add up to the file's real size), and every structural surprise (schema,
array names, dtypes, shapes) is a ``CheckpointError``. ``latest_checkpoint`` then falls back to
the previous checkpoint, so a damaged one costs a warning, not a crash, a hang or the memory.
"""

from __future__ import annotations

import json
import os
import stat
import time
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, Any

from dp_core._checkpoint_arrays import arrays_of, damaged
from dp_core._checkpoint_format import (
    CHECKPOINT_NAME,
    FILES,
    FORMAT_NAME,
    FORMAT_VERSION,
    GROUPS,
    JSON_LIMIT,
    Checkpoint,
    CheckpointError,
    CheckpointVersionError,
    kind_of,
    sha256_of,
)
from dp_core._checkpoint_lock import CheckpointDirError, existing_folder_of
from dp_core._checkpoint_shards import PARTS_FORMAT_VERSION, check_parts_names, load_parts, stored_parts

_STATE_REQUIRED = ("epoch", "step", "seed", "global_batch_size", "num_replicas", "counts")
_STATE_OPTIONAL = ("lr_policy", "extra")
# O_NOFOLLOW: a symlink is refused, not followed; O_NONBLOCK: opening a FIFO cannot block.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def list_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """Checkpoint directories under ``directory``, oldest first (none when it does not exist).

    Temporary ``.tmp-*`` directories are ignored; a ``step-*`` entry that is not a real
    directory (a symlink, a plain file) is ignored with a warning. Checkpoints of a newer
    format are listed too (``latest_checkpoint`` refuses them). A ``directory`` that is a file,
    or lies under one, or cannot be read, is a ``CheckpointDirError``.
    """
    root = Path(directory)
    found: list[tuple[tuple[str, ...], Path]] = []
    for _ in range(10):  # listed again while entries vanish under it: a writer pruning, say
        found, vanished = [], False
        for entry in _entries(root):
            match = CHECKPOINT_NAME.match(entry.name)
            if match is None:
                continue
            path = root / entry.name
            try:  # the type comes with the listing where the filesystem gives it
                mode = None if entry.is_dir(follow_symlinks=False) else os.lstat(path).st_mode
            except OSError:  # removed meanwhile; what replaced it may be missing from this listing
                vanished = True
                continue
            if mode is not None:
                warnings.warn(
                    f"Ignoring {path}: it is {kind_of(mode)}, not a checkpoint directory. Checkpoints are real "
                    "directories; remove it.",
                    stacklevel=2,
                )
                continue
            found.append((match.groups(), path))
        if not vanished:
            break
    return [path for _, path in sorted(found)]


def _entries(root: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(root) as entries:
            return list(entries)
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        existing_folder_of(Path(os.path.abspath(root)))  # raises, naming the file in the way
        raise CheckpointDirError(f"checkpoint_dir {str(root)!r} is not a folder.") from None
    except OSError as error:
        raise CheckpointDirError(
            f"checkpoint_dir {str(root)!r} cannot be listed ({error.strerror or error}); make it readable, or "
            "point checkpoint_dir at another folder."
        ) from error


def load_checkpoint(path: str | os.PathLike[str], *, lazily: bool = False) -> Checkpoint:
    """Read and verify one checkpoint directory; a ``CheckpointError`` says what is wrong. ``lazily``: one
    written by parts (format 2) gives each array as a ``StoredArray``, read and checked when asked for."""
    path = Path(path)
    try:
        return _load(path, lazily=lazily)
    except CheckpointError:
        raise
    except (OSError, ValueError, EOFError, RecursionError, zipfile.BadZipFile, NotImplementedError) as error:
        raise CheckpointError(f"{path}: unreadable ({type(error).__name__}: {error}).") from error


def latest_checkpoint(directory: str | os.PathLike[str], *, lazily: bool = False) -> Checkpoint | None:
    """The newest checkpoint that verifies (``lazily``: as ``load_checkpoint``'s); damaged ones are skipped.

    None when there is none; when every one is damaged, a warning says the run starts from
    the beginning. A checkpoint of a newer format version anywhere in ``directory`` is a
    ``CheckpointVersionError`` naming both versions: it is never skipped.

    A writer may prune or replace checkpoints while this reads: one that vanishes is not
    damage, and the folder is listed again until a listing holds still, so a reader never
    starts from the beginning while a complete checkpoint exists.
    """
    failures: dict[Path, tuple[tuple[int, int, int], CheckpointError]] = {}
    for _ in range(_ROUNDS):
        paths, changed = list_checkpoints(directory), False
        _refuse_newer_formats(directory, paths)
        for path in reversed(paths):
            before = _identity(path)
            if before is None or failures.get(path, (None,))[0] == before:
                continue  # vanished, or found damaged before
            try:
                checkpoint = load_checkpoint(path, lazily=lazily)
            except CheckpointVersionError:
                _refuse_newer_formats(directory, [path])
                raise
            except CheckpointError as error:
                if _identity(path) == before:
                    failures[path] = (before, error)
                else:  # pruned or replaced while being read: not damage
                    changed = True
                continue
            _warn_damaged(failures, found=True, moving=changed or list_checkpoints(directory) != paths)
            return checkpoint
        if not changed and list_checkpoints(directory) == paths:  # it held still: what failed is damaged
            break
    damaged = _warn_damaged(failures, found=False, moving=False)
    if damaged:
        warnings.warn(
            f"No usable checkpoint in {directory}: all {damaged} are damaged, so training starts from the "
            "beginning. Move them away to silence this.",
            stacklevel=2,
        )
    return None


# A writer replacing checkpoints faster than this many listings is not a writer of ours.
_ROUNDS = 100


def _identity(path: Path) -> tuple[int, int, int] | None:
    """Which directory ``path`` is, and when its entries last changed (a prune in progress
    changes it), or None once it is gone."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_mtime_ns


def _has_entries(path: Path) -> bool:
    """False for an emptied directory: a prune's last moment, not a checkpoint."""
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is not None
    except OSError:
        return False


def _warn_damaged(
    failures: dict[Path, tuple[tuple[int, int, int], CheckpointError]], *, found: bool, moving: bool
) -> int:
    """A warning for each damaged checkpoint still there (one that vanished was pruned), newest
    first; returns how many."""
    if failures and moving:
        time.sleep(0.05)  # a prune under way ends: what it removes is not damage
    still_there = [
        error for path, (identity, error) in failures.items() if _identity(path) == identity and _has_entries(path)
    ]
    for i, error in enumerate(still_there):
        last = not found and i == len(still_there) - 1
        then = "No earlier checkpoint is left." if last else "Falling back to the previous one."
        warnings.warn(f"Skipping checkpoint: {error} {then}", stacklevel=3)
    return len(still_there)


def newer_format_version(path: Path) -> int | None:
    """The format version ``path``'s manifest declares when it is newer than this reader's, else
    None (also when the manifest cannot be read: that is damage, found when it is loaded)."""
    try:
        _manifest(path)
    except CheckpointVersionError as error:
        return error.version
    except (CheckpointError, OSError):
        return None
    return None


def _refuse_newer_formats(directory: str | os.PathLike[str], paths: list[Path]) -> None:
    newer = [(path, version) for path in paths if (version := newer_format_version(path)) is not None]
    if not newer:
        return
    path, version = newer[-1]
    names = ", ".join(p.name for p, _ in newer)
    raise CheckpointVersionError(
        f"checkpoint_dir {str(directory)!r} holds {len(newer)} checkpoint(s) in format version {version} ({names}), "
        f"written by a newer keras-dp; this one (dp-core {_dp_core_version()}) reads format version "
        f"{FORMAT_VERSION} only, so it can neither resume from them nor write next to them (a newer run writes "
        "there). Nothing was changed. Upgrade keras-dp (dp-core and the backend) to the version that wrote "
        "them, or point checkpoint_dir at another folder to start a separate run.",
        path=str(path),
        version=version,
    )


def _dp_core_version() -> str:
    try:
        from importlib.metadata import version

        return version("dp-core")
    except Exception:  # an unpacked source tree without metadata
        return "unknown"


# Every check below runs before the bytes it guards are read or allocated.


def _load(path: Path, *, lazily: bool = False) -> Checkpoint:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint directory.") from None
    if not stat.S_ISDIR(mode):
        raise CheckpointError(f"{path}: it is {kind_of(mode)}, not a checkpoint directory.")
    manifest = _manifest(path)
    with _verified(path, "state.json", manifest) as (f, size):
        state = _state(path, _parse_json(path, "state.json", f.read(size + 1)))
    if manifest["format_version"] == PARTS_FORMAT_VERSION:
        groups = _parts_of(path, manifest, state["counts"], lazily=lazily)
    else:
        with _verified(path, "arrays.npz", manifest) as (f, size):
            groups = arrays_of(path, f, size, state["counts"], manifest.get("arrays"))
    return Checkpoint(
        epoch=state["epoch"],
        step=state["step"],
        seed=state["seed"],
        global_batch_size=state["global_batch_size"],
        num_replicas=state["num_replicas"],
        lr_policy=state.get("lr_policy"),
        extra=state.get("extra", {}),
        **groups,
    )


def _parts_of(path: Path, manifest: dict[str, Any], counts: dict[str, int], *, lazily: bool) -> dict[str, list[Any]]:
    """A version-2 checkpoint's whole arrays (or ``lazily`` each read when asked for), from its parts
    files, each verified first."""
    with ExitStack() as stack:
        opened = {
            name: stack.enter_context(_verified(path, name, manifest))
            for name in manifest["files"]
            if name != "state.json"
        }
        if lazily:
            return stored_parts(path, {name: f for name, (f, _) in opened.items()}, counts, manifest)
        return load_parts(path, opened, counts, manifest)


@contextmanager
def _regular_file(path: Path, name: str) -> Iterator[tuple[IO[bytes], int]]:
    """``path / name`` open for reading, and its size, if it is a regular file in ``path``."""
    try:
        before = os.lstat(path / name)
    except FileNotFoundError:
        raise damaged(path, name, "the file is missing") from None
    if not stat.S_ISREG(before.st_mode):  # refused before opening: opening a device can have effects
        raise damaged(path, name, f"it is {kind_of(before.st_mode)}, not a regular file (not read)")
    fd = os.open(path / name, _OPEN_FLAGS)
    with os.fdopen(fd, "rb") as f:
        after = os.fstat(fd)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino) or not stat.S_ISREG(after.st_mode):
            raise CheckpointError(f"{path}: {name} was replaced while being opened.")
        yield f, after.st_size


def _manifest(path: Path) -> dict[str, Any]:
    with _regular_file(path, "manifest.json") as (f, size):
        if size > JSON_LIMIT:
            raise damaged(path, "manifest.json", f"{size} bytes, more than the {JSON_LIMIT} a manifest may have")
        manifest = _parse_json(path, "manifest.json", f.read(size + 1), unreadable=True)
    version = manifest.get("format_version")
    if (
        manifest.get("format") == FORMAT_NAME
        and isinstance(version, int)
        and _count(version)
        and version > FORMAT_VERSION
    ):
        raise CheckpointVersionError(
            f"{path}: format {FORMAT_NAME!r} version {version}, expected {FORMAT_NAME} version {FORMAT_VERSION}: it "
            "was written by a newer keras-dp. Upgrade keras-dp to read it, or point checkpoint_dir at another folder.",
            path=str(path),
            version=version,
        )
    if manifest.get("format") != FORMAT_NAME or not _count(version) or version not in (1, PARTS_FORMAT_VERSION):
        raise CheckpointError(
            f"{path}: format {manifest.get('format')!r} version {manifest.get('format_version')!r}, "
            f"expected {FORMAT_NAME} version 1 or {PARTS_FORMAT_VERSION}."
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise damaged(path, "manifest.json", f"'files' is {_short(files)}, expected a SHA-256 for each file")
    expected = FILES if version == 1 else ("state.json", *check_parts_names(path, files))
    if set(files) != set(expected):
        raise damaged(path, "manifest.json", f"'files' is {_short(files)}, expected a SHA-256 for each of {FILES}")
    sizes = manifest.get("sizes")  # absent in checkpoints of dp-core 0.2.1 and before
    if sizes is not None and (
        not isinstance(sizes, dict) or set(sizes) != set(expected) or not all(map(_count, sizes.values()))
    ):
        raise damaged(path, "manifest.json", f"'sizes' is {_short(sizes)}, expected a byte count for each file")
    records = manifest.get("arrays")
    if records is not None and (not isinstance(records, dict) or not all(map(_is_record, records.values()))):
        raise damaged(path, "manifest.json", "'arrays' is not a {name: {dtype, shape}} mapping")
    return manifest


@contextmanager
def _verified(path: Path, name: str, manifest: dict[str, Any]) -> Iterator[tuple[IO[bytes], int]]:
    """``name`` open at its start after its size and SHA-256 matched the manifest."""
    with _regular_file(path, name) as (f, size):
        recorded = (manifest.get("sizes") or {}).get(name)
        if recorded is not None and size != recorded:
            raise damaged(path, name, f"{size} bytes, but the manifest says {recorded}")
        if name.endswith(".json") and size > JSON_LIMIT:
            raise damaged(path, name, f"{size} bytes, more than the {JSON_LIMIT} a JSON file may have")
        actual, expected = sha256_of(f), manifest["files"][name]
        if actual != expected:
            raise CheckpointError(f"{path}: {name} is damaged (SHA-256 {actual[:12]}, manifest says {expected[:12]}).")
        f.seek(0)
        yield f, size


def _parse_json(path: Path, name: str, data: bytes, *, unreadable: bool = False) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as error:  # RecursionError: nested too deep to be ours
        if unreadable:
            raise CheckpointError(f"{path}: unreadable {name} ({type(error).__name__}: {error}).") from error
        raise damaged(path, name, f"not JSON ({type(error).__name__}: {error})") from error
    if not isinstance(value, dict):
        raise damaged(path, name, f"it holds {type(value).__name__}, expected an object")
    return value


def _state(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """``state.json`` checked against the one schema ``save_checkpoint`` writes."""
    missing = [key for key in _STATE_REQUIRED if key not in state]
    unknown = sorted(set(state) - {*_STATE_REQUIRED, *_STATE_OPTIONAL})
    if missing or unknown:
        raise damaged(path, "state.json", f"keys missing: {missing}, unknown: {unknown}")
    for key, minimum in (("epoch", 0), ("step", 0), ("seed", None), ("global_batch_size", 1), ("num_replicas", 1)):
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
            expected = "an integer" if minimum is None else f"an integer >= {minimum}"
            raise damaged(path, "state.json", f"{key} is {_short(value)}, expected {expected}")
    counts = state["counts"]
    if not isinstance(counts, dict) or set(counts) != set(GROUPS) or not all(map(_count, counts.values())):
        raise damaged(path, "state.json", f"counts is {_short(counts)}, expected a count for each of {GROUPS}")
    if not isinstance(state.get("lr_policy"), (dict, type(None))) or not isinstance(state.get("extra", {}), dict):
        raise damaged(path, "state.json", "lr_policy must be an object or null, extra an object")
    match = CHECKPOINT_NAME.match(path.name)
    if match is not None and (int(match[1]), int(match[2])) != (state["epoch"], state["step"]):
        raise damaged(
            path, "state.json", f"it is of epoch {state['epoch']}, step {state['step']}, not those the name says"
        )
    return state


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_record(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("dtype"), str)
        and isinstance(value.get("shape"), list)
        and all(map(_count, value["shape"]))
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
