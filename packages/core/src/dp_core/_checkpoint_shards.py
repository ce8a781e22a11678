"""Format version 2: a checkpoint written by parts, each process the parts it holds.

A model whose arrays are split over devices (jax-dp's ``Trainer.scope()``) is checkpointed without
gathering any array whole: an array of the ``Checkpoint`` may be a ``Parts`` (its shape, dtype and
this process's ``Part`` s, one replica of each distinct part). ``save_checkpoint`` then writes
``parts-<process>.npz`` (members ``<group>/<i>/<k>.npy``, stored as ``arrays.npz``'s are) instead of
``arrays.npz``, and the manifest, of ``format_version`` 2, adds ``parts``: for each array, where each
of its parts lies (``[file, member, [start, ...]]``). Reading (``load_parts``) verifies every file
against the manifest as version 1 does, checks that each array's parts lie inside it, do not
overlap and cover it exactly, and gives back whole arrays: a version-2 checkpoint resumes like a
version-1 one, on any device count and in any mode. A checkpoint without parts is written as
version 1, which every dp-core since 0.2.1 reads.
"""

from __future__ import annotations

import math
import os
import zipfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from dp_core._checkpoint_arrays import _array, damaged
from dp_core._checkpoint_format import GROUPS, NUMERIC_KINDS, CheckpointError

PARTS_FORMAT_VERSION = 2


@dataclass(frozen=True)
class Part:
    """The values of an array from ``start`` (one index per dimension) on, ``values.shape`` long."""

    start: tuple[int, ...]
    values: np.ndarray


@dataclass(frozen=True)
class Parts:
    """An array of ``shape`` and ``dtype`` given by its parts (those this process writes)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    parts: list[Part]


def is_parts(value: Any) -> bool:
    """A ``Parts``, or any value with its fields (``shape``, ``dtype``, ``parts`` of ``start`` and
    ``values``): a backend that cannot import this module's names passes its own."""
    return isinstance(value, Parts) or all(hasattr(value, name) for name in ("shape", "dtype", "parts"))


def has_parts(checkpoint: Any) -> bool:
    return any(is_parts(array) for group in GROUPS for array in getattr(checkpoint, group))


def parts_file(process: int) -> str:
    return f"parts-{process}.npz"


def write_parts(path: Path, arrays: dict[str, Any], file: str) -> dict[str, list[list[Any]]]:
    """``arrays``' parts into ``path`` (an ``.npz`` of stored members); returns the manifest's
    ``parts`` entries: for each array, ``[file, member, start]`` per part."""
    members, table = {}, {}
    for key, array in arrays.items():
        table[key] = []
        for k, part in enumerate(array.parts):
            values = np.asarray(part.values)
            if values.dtype.kind not in NUMERIC_KINDS or values.dtype != np.dtype(array.dtype):
                raise TypeError(f"{key} part {k} has dtype {values.dtype}, the array {array.dtype}.")
            members[f"{key}/{k}"] = values
            table[key].append([file, f"{key}/{k}.npy", list(part.start)])
    with open(path, "wb") as f:
        np.savez(f, **members)  # stored, not compressed, as arrays.npz
    return table


def load_parts(
    path: Path, opened: dict[str, tuple[IO[bytes], int]], counts: dict[str, int], manifest: dict[str, Any]
) -> dict[str, list[np.ndarray]]:
    """The whole arrays of a version-2 checkpoint, by group, from its verified ``opened`` parts files
    (each open at its start, with its size)."""
    records, table = manifest.get("arrays"), manifest.get("parts")
    expected = [f"{group}/{i}" for group in GROUPS for i in range(counts[group])]
    if not isinstance(records, dict) or not isinstance(table, dict) or set(records) != set(expected):
        raise damaged(path, "manifest.json", "its arrays or parts are not those state.json counts")
    if set(table) != set(expected):
        raise damaged(path, "manifest.json", "'parts' does not list every array")
    archives = {name: (zipfile.ZipFile(f), size) for name, (f, size) in opened.items()}
    used: set[tuple[str, str]] = set()
    whole = {key: _assembled(path, key, records[key], table[key], archives, used) for key in expected}
    listed = {(name, member.filename) for name, (archive, _) in archives.items() for member in archive.infolist()}
    if listed != used:
        raise damaged(path, "parts", f"members no array claims: {sorted(listed - used)[:5]}")
    return {group: [whole[f"{group}/{i}"] for i in range(counts[group])] for group in GROUPS}


class StoredArray:
    """One array of a verified version-2 checkpoint, read from its parts files when asked for
    (``numpy.asarray``), with the same checks ``load_parts`` makes; a file that is no longer the one
    verified (another inode, size or time) is damage. What ``load_checkpoint(path, lazily=True)``
    gives, so a reader holds one array at a time."""

    def __init__(self, path: Path, key: str, record: dict[str, Any], entries: Any, files: dict[str, Any]) -> None:
        self.path, self.key, self.record, self.entries, self.files = path, key, record, entries, files
        self.shape = tuple(record["shape"])
        self.dtype = np.dtype(np.lib.format.descr_to_dtype(record["dtype"]))
        self.ndim = len(self.shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        names = sorted({entry[0] for entry in self.entries if isinstance(entry, list) and entry})
        with ExitStack() as stack:
            archives: dict[str, tuple[zipfile.ZipFile, int]] = {}
            for name in names:
                if name not in self.files:
                    raise damaged(self.path, "manifest.json", f"{self.key}: {name} is not a file it lists")
                f = stack.enter_context(open(self.path / name, "rb"))
                if _identity_of(f) != self.files[name]:
                    raise damaged(self.path, name, "the file changed since it was verified")
                archives[name] = (stack.enter_context(zipfile.ZipFile(f)), self.files[name][2])
            whole = _assembled(self.path, self.key, self.record, self.entries, archives, set())
        return whole if dtype is None else whole.astype(dtype, copy=False)


def _identity_of(f: IO[bytes]) -> tuple[int, int, int, int]:
    info = os.fstat(f.fileno())
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def stored_parts(
    path: Path, files: dict[str, IO[bytes]], counts: dict[str, int], manifest: dict[str, Any]
) -> dict[str, list[StoredArray]]:
    """``load_parts``' arrays, each read when asked for (``StoredArray``), from the verified ``files``
    (each open; their identities are kept and checked again at each read)."""
    records, table = manifest.get("arrays"), manifest.get("parts")
    expected = [f"{group}/{i}" for group in GROUPS for i in range(counts[group])]
    if not isinstance(records, dict) or not isinstance(table, dict) or set(records) != set(expected):
        raise damaged(path, "manifest.json", "its arrays or parts are not those state.json counts")
    if set(table) != set(expected):
        raise damaged(path, "manifest.json", "'parts' does not list every array")
    identities = {name: _identity_of(f) for name, f in files.items()}
    arrays = {key: StoredArray(path, key, records[key], table[key], identities) for key in expected}
    return {group: [arrays[f"{group}/{i}"] for i in range(counts[group])] for group in GROUPS}


def _assembled(
    path: Path,
    key: str,
    record: dict[str, Any],
    entries: Any,
    archives: dict[str, tuple[zipfile.ZipFile, int]],
    used: set[tuple[str, str]],
) -> np.ndarray:
    """One array from its parts: each part read with ``arrays.npz``'s checks, inside the array, none
    overlapping another, together exactly its size."""
    shape, dtype = tuple(record["shape"]), np.dtype(np.lib.format.descr_to_dtype(record["dtype"]))
    if dtype.kind not in NUMERIC_KINDS or dtype.hasobject:
        raise damaged(path, "manifest.json", f"{key} has dtype {dtype}, not a number type")
    if not isinstance(entries, list) or not all(_is_entry(entry, len(shape)) for entry in entries):
        raise damaged(path, "manifest.json", f"the parts of {key} are not [file, member, start] entries")
    whole = np.empty(shape, dtype)
    boxes: list[tuple[tuple[int, int], ...]] = []
    for file, member_name, start in entries:
        if file not in archives or (file, member_name) in used:
            raise damaged(path, "manifest.json", f"{key}: {file}/{member_name} is missing or claimed twice")
        used.add((file, member_name))
        archive, size = archives[file]
        member = _member(path, archive, member_name, size)
        values = _array(path, archive, member, None)
        box = tuple((s, s + n) for s, n in zip(start, values.shape, strict=True))
        if values.dtype != dtype or any(stop > limit for (_, stop), limit in zip(box, shape, strict=True)):
            raise damaged(path, file, f"{member_name} is {values.dtype} at {box}, outside {key}'s {dtype} {shape}")
        if any(_overlap(box, other) for other in boxes):
            raise damaged(path, file, f"{member_name} overlaps another part of {key}")
        boxes.append(box)
        whole[tuple(slice(a, b) for a, b in box)] = values
    if sum(math.prod(b - a for a, b in box) for box in boxes) != math.prod(shape):
        raise damaged(path, "manifest.json", f"the parts of {key} do not cover it")
    return whole


def _member(path: Path, archive: zipfile.ZipFile, name: str, size: int) -> zipfile.ZipInfo:
    try:
        member = archive.getinfo(name)
    except KeyError:
        raise damaged(path, "parts", f"{name} is missing") from None
    if member.flag_bits & 0x1 or member.compress_type != zipfile.ZIP_STORED or member.file_size != member.compress_size:
        raise damaged(path, "parts", f"{name} is compressed or encrypted; checkpoints never are")
    if member.header_offset + member.compress_size > size:
        raise damaged(path, "parts", f"{name} claims {member.file_size} bytes past the file's end")
    return member


def _is_entry(entry: Any, ndim: int) -> bool:
    return (
        isinstance(entry, list)
        and len(entry) == 3
        and isinstance(entry[0], str)
        and isinstance(entry[1], str)
        and isinstance(entry[2], list)
        and len(entry[2]) == ndim
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in entry[2])
    )


def _overlap(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> bool:
    return all(x0 < y1 and y0 < x1 for (x0, x1), (y0, y1) in zip(a, b, strict=True)) and bool(a)


def check_parts_names(path: Path, files: dict[str, Any]) -> list[str]:
    """The parts files a version-2 manifest lists (``parts-<n>.npz``), besides ``state.json``."""
    names = sorted(name for name in files if name != "state.json")
    if "state.json" not in files or not names or not all(_is_parts_name(name) for name in names):
        raise CheckpointError(f"{path}: manifest.json lists {names[:5]}, expected state.json and parts-<n>.npz files.")
    return names


def _is_parts_name(name: str) -> bool:
    stem = name.removeprefix("parts-").removesuffix(".npz")
    return name.startswith("parts-") and name.endswith(".npz") and stem.isdigit()
