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
import math
import os
import stat
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import numpy as np

from dp_core._checkpoint_format import (
    CHECKPOINT_NAME,
    FILES,
    FORMAT_NAME,
    FORMAT_VERSION,
    GROUPS,
    JSON_LIMIT,
    NUMERIC_KINDS,
    Checkpoint,
    CheckpointError,
    kind_of,
    sha256_of,
)

_STATE_REQUIRED = ("epoch", "step", "seed", "global_batch_size", "num_replicas", "counts")
_STATE_OPTIONAL = ("lr_policy", "extra")
# O_NOFOLLOW: a symlink is refused, not followed; O_NONBLOCK: opening a FIFO cannot block.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def list_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """Checkpoint directories under ``directory``, oldest first.

    Temporary ``.tmp-*`` directories are ignored; a ``step-*`` entry that is not a real
    directory (a symlink, a plain file) is ignored with a warning.
    """
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = CHECKPOINT_NAME.match(path.name)
        if match is None:
            continue
        try:
            mode = os.lstat(path).st_mode
        except OSError:  # removed meanwhile (pruned by the writer)
            continue
        if not stat.S_ISDIR(mode):
            warnings.warn(
                f"Ignoring {path}: it is {kind_of(mode)}, not a checkpoint directory. Checkpoints are real "
                "directories; remove it.",
                stacklevel=2,
            )
            continue
        found.append((match.groups(), path))
    return [path for _, path in sorted(found)]


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read and verify one checkpoint directory; a ``CheckpointError`` says what is wrong."""
    path = Path(path)
    try:
        return _load(path)
    except CheckpointError:
        raise
    except (OSError, ValueError, EOFError, RecursionError, zipfile.BadZipFile, NotImplementedError) as error:
        raise CheckpointError(f"{path}: unreadable ({type(error).__name__}: {error}).") from error


def latest_checkpoint(directory: str | os.PathLike[str]) -> Checkpoint | None:
    """The newest checkpoint that verifies; damaged ones are reported and skipped.

    None when there is none; when every one is damaged, a warning says the run starts from
    the beginning.
    """
    paths = list_checkpoints(directory)
    for remaining, path in reversed(list(enumerate(paths))):
        try:
            return load_checkpoint(path)
        except CheckpointError as error:
            then = "Falling back to the previous one." if remaining else "No earlier checkpoint is left."
            warnings.warn(f"Skipping checkpoint: {error} {then}", stacklevel=2)
    if paths:
        warnings.warn(
            f"No usable checkpoint in {directory}: all {len(paths)} are damaged, so training starts from the "
            "beginning. Move them away to silence this.",
            stacklevel=2,
        )
    return None


# Every check below runs before the bytes it guards are read or allocated.


def _load(path: Path) -> Checkpoint:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint directory.") from None
    if not stat.S_ISDIR(mode):
        raise CheckpointError(f"{path}: it is {kind_of(mode)}, not a checkpoint directory.")
    manifest = _manifest(path)
    with _verified(path, "state.json", manifest) as (f, size):
        state = _state(path, _parse_json(path, "state.json", f.read(size + 1)))
    with _verified(path, "arrays.npz", manifest) as (f, size):
        groups = _arrays(path, f, size, state["counts"], manifest.get("arrays"))
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


def _damaged(path: Path, name: str, problem: str) -> CheckpointError:
    return CheckpointError(f"{path}: {name} is damaged: {problem}.")


@contextmanager
def _regular_file(path: Path, name: str) -> Iterator[tuple[IO[bytes], int]]:
    """``path / name`` open for reading, and its size, if it is a regular file in ``path``."""
    try:
        before = os.lstat(path / name)
    except FileNotFoundError:
        raise _damaged(path, name, "the file is missing") from None
    if not stat.S_ISREG(before.st_mode):  # refused before opening: opening a device can have effects
        raise _damaged(path, name, f"it is {kind_of(before.st_mode)}, not a regular file (not read)")
    fd = os.open(path / name, _OPEN_FLAGS)
    with os.fdopen(fd, "rb") as f:
        after = os.fstat(fd)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino) or not stat.S_ISREG(after.st_mode):
            raise CheckpointError(f"{path}: {name} was replaced while being opened.")
        yield f, after.st_size


def _manifest(path: Path) -> dict[str, Any]:
    with _regular_file(path, "manifest.json") as (f, size):
        if size > JSON_LIMIT:
            raise _damaged(path, "manifest.json", f"{size} bytes, more than the {JSON_LIMIT} a manifest may have")
        manifest = _parse_json(path, "manifest.json", f.read(size + 1), unreadable=True)
    if manifest.get("format") != FORMAT_NAME or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format {manifest.get('format')!r} version {manifest.get('format_version')!r}, "
            f"expected {FORMAT_NAME} version {FORMAT_VERSION}."
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or set(files) != set(FILES) or not all(isinstance(v, str) for v in files.values()):
        raise _damaged(path, "manifest.json", f"'files' is {_short(files)}, expected a SHA-256 for each of {FILES}")
    sizes = manifest.get("sizes")  # absent in checkpoints of dp-core 0.2.1 and before
    if sizes is not None and (
        not isinstance(sizes, dict) or set(sizes) != set(FILES) or not all(map(_count, sizes.values()))
    ):
        raise _damaged(path, "manifest.json", f"'sizes' is {_short(sizes)}, expected a byte count for each of {FILES}")
    records = manifest.get("arrays")
    if records is not None and (not isinstance(records, dict) or not all(map(_is_record, records.values()))):
        raise _damaged(path, "manifest.json", "'arrays' is not a {name: {dtype, shape}} mapping")
    return manifest


@contextmanager
def _verified(path: Path, name: str, manifest: dict[str, Any]) -> Iterator[tuple[IO[bytes], int]]:
    """``name`` open at its start after its size and SHA-256 matched the manifest."""
    with _regular_file(path, name) as (f, size):
        recorded = (manifest.get("sizes") or {}).get(name)
        if recorded is not None and size != recorded:
            raise _damaged(path, name, f"{size} bytes, but the manifest says {recorded}")
        if name.endswith(".json") and size > JSON_LIMIT:
            raise _damaged(path, name, f"{size} bytes, more than the {JSON_LIMIT} a JSON file may have")
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
        raise _damaged(path, name, f"not JSON ({type(error).__name__}: {error})") from error
    if not isinstance(value, dict):
        raise _damaged(path, name, f"it holds {type(value).__name__}, expected an object")
    return value


def _state(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """``state.json`` checked against the one schema ``save_checkpoint`` writes."""
    missing = [key for key in _STATE_REQUIRED if key not in state]
    unknown = sorted(set(state) - {*_STATE_REQUIRED, *_STATE_OPTIONAL})
    if missing or unknown:
        raise _damaged(path, "state.json", f"keys missing: {missing}, unknown: {unknown}")
    for key, minimum in (("epoch", 0), ("step", 0), ("seed", None), ("global_batch_size", 1), ("num_replicas", 1)):
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
            expected = "an integer" if minimum is None else f"an integer >= {minimum}"
            raise _damaged(path, "state.json", f"{key} is {_short(value)}, expected {expected}")
    counts = state["counts"]
    if not isinstance(counts, dict) or set(counts) != set(GROUPS) or not all(map(_count, counts.values())):
        raise _damaged(path, "state.json", f"counts is {_short(counts)}, expected a count for each of {GROUPS}")
    if not isinstance(state.get("lr_policy"), (dict, type(None))) or not isinstance(state.get("extra", {}), dict):
        raise _damaged(path, "state.json", "lr_policy must be an object or null, extra an object")
    match = CHECKPOINT_NAME.match(path.name)
    if match is not None and (int(match[1]), int(match[2])) != (state["epoch"], state["step"]):
        raise _damaged(
            path, "state.json", f"it is of epoch {state['epoch']}, step {state['step']}, not those the name says"
        )
    return state


def _arrays(
    path: Path, f: IO[bytes], size: int, counts: dict[str, int], records: dict[str, Any] | None
) -> dict[str, list[np.ndarray]]:
    """The arrays of ``arrays.npz`` (``size`` bytes on disk), by group. Members are stored, not
    compressed, so no member can unpack to more than its share of the file: nothing read here
    adds up to more than ``size`` bytes."""
    archive = zipfile.ZipFile(f)
    members = archive.infolist()
    total = sum(counts.values())
    if total > len(members):  # checked first: ``expected`` is never longer than the archive's list
        raise _damaged(path, "arrays.npz", f"state.json counts {total} arrays, it holds {len(members)}")
    expected = [f"{group}/{i}" for group in GROUPS for i in range(counts[group])]
    names, wanted = [member.filename for member in members], {f"{key}.npy" for key in expected}
    if len(names) != len(wanted) or set(names) != wanted:
        unknown, missing = sorted(set(names) - wanted), sorted(wanted - set(names))
        raise _damaged(path, "arrays.npz", f"arrays not in state.json: {unknown[:5]}, missing: {missing[:5]}")
    if records is not None and set(records) != set(expected):
        raise _damaged(path, "arrays.npz", "its arrays are not those the manifest lists")
    for member in members:
        if member.flag_bits & 0x1:
            raise _damaged(path, "arrays.npz", f"{member.filename} is encrypted; checkpoints never are")
        if member.compress_type != zipfile.ZIP_STORED or member.file_size != member.compress_size:
            raise _damaged(path, "arrays.npz", f"{member.filename} is compressed; checkpoints never are")
        if member.header_offset + member.compress_size > size:
            raise _damaged(path, "arrays.npz", f"{member.filename} claims {member.file_size} bytes past the file's end")
    if sum(member.file_size for member in members) > size:
        raise _damaged(path, "arrays.npz", f"its members claim more bytes than the file's {size}")
    by_name = {member.filename: member for member in members}
    arrays = {key: _array(path, archive, by_name[f"{key}.npy"], (records or {}).get(key)) for key in expected}
    return {group: [arrays[f"{group}/{i}"] for i in range(counts[group])] for group in GROUPS}


def _array(path: Path, archive: zipfile.ZipFile, member: zipfile.ZipInfo, record: dict[str, Any] | None) -> np.ndarray:
    """One ``.npy`` member; its header is checked against its size and the manifest's record
    before the array is allocated."""
    with archive.open(member) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise _damaged(path, "arrays.npz", f"{member.filename} is .npy version {version}, not 1.0 or 2.0")
        if not all(n >= 0 for n in shape):
            raise _damaged(path, "arrays.npz", f"{member.filename} has shape {shape}")
        if dtype.kind not in NUMERIC_KINDS or dtype.hasobject or dtype.subdtype is not None:
            raise _damaged(path, "arrays.npz", f"{member.filename} has dtype {dtype}, not a number type")
        nbytes = math.prod(shape) * dtype.itemsize
        if f.tell() + nbytes != member.file_size:
            raise _damaged(
                path, "arrays.npz", f"{member.filename} says shape {shape} of {dtype}, which is not its size"
            )
        if record is not None and (record["shape"], record["dtype"]) != (
            list(shape),
            np.lib.format.dtype_to_descr(dtype),
        ):
            raise _damaged(path, "arrays.npz", f"{member.filename} is {dtype} {shape}, the manifest says otherwise")
        flat = np.empty(math.prod(shape), dtype=dtype)
        raw = flat.view(np.uint8)
        done = 0
        while done < nbytes:
            chunk = f.read(min(nbytes - done, 1 << 20))
            if not chunk:
                raise _damaged(path, "arrays.npz", f"{member.filename} ends early")
            raw[done : done + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            done += len(chunk)
    return flat.reshape(shape[::-1]).transpose() if fortran_order else flat.reshape(shape)


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
