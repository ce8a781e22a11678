"""The arrays of a checkpoint's ``arrays.npz``, read as possibly crafted: stored members only,
each ``.npy`` header checked against its size and the manifest's record before anything is
allocated, so nothing read adds up to more than the file's bytes on disk."""

from __future__ import annotations

import math
import zipfile
from pathlib import Path
from typing import IO, Any

import numpy as np

from dp_core._checkpoint_format import GROUPS, NUMERIC_KINDS, CheckpointError


def damaged(path: Path, name: str, problem: str) -> CheckpointError:
    return CheckpointError(f"{path}: {name} is damaged: {problem}.")


def arrays_of(
    path: Path, f: IO[bytes], size: int, counts: dict[str, int], records: dict[str, Any] | None
) -> dict[str, list[np.ndarray]]:
    """The arrays of ``arrays.npz`` (``size`` bytes on disk), by group. Members are stored, not
    compressed, so no member can unpack to more than its share of the file: nothing read here
    adds up to more than ``size`` bytes."""
    archive = zipfile.ZipFile(f)
    members = archive.infolist()
    total = sum(counts.values())
    if total > len(members):  # checked first: ``expected`` is never longer than the archive's list
        raise damaged(path, "arrays.npz", f"state.json counts {total} arrays, it holds {len(members)}")
    expected = [f"{group}/{i}" for group in GROUPS for i in range(counts[group])]
    names, wanted = [member.filename for member in members], {f"{key}.npy" for key in expected}
    if len(names) != len(wanted) or set(names) != wanted:
        unknown, missing = sorted(set(names) - wanted), sorted(wanted - set(names))
        raise damaged(path, "arrays.npz", f"arrays not in state.json: {unknown[:5]}, missing: {missing[:5]}")
    if records is not None and set(records) != set(expected):
        raise damaged(path, "arrays.npz", "its arrays are not those the manifest lists")
    for member in members:
        if member.flag_bits & 0x1:
            raise damaged(path, "arrays.npz", f"{member.filename} is encrypted; checkpoints never are")
        if member.compress_type != zipfile.ZIP_STORED or member.file_size != member.compress_size:
            raise damaged(path, "arrays.npz", f"{member.filename} is compressed; checkpoints never are")
        if member.header_offset + member.compress_size > size:
            raise damaged(path, "arrays.npz", f"{member.filename} claims {member.file_size} bytes past the file's end")
    if sum(member.file_size for member in members) > size:
        raise damaged(path, "arrays.npz", f"its members claim more bytes than the file's {size}")
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
            raise damaged(path, "arrays.npz", f"{member.filename} is .npy version {version}, not 1.0 or 2.0")
        if not all(n >= 0 for n in shape):
            raise damaged(path, "arrays.npz", f"{member.filename} has shape {shape}")
        if dtype.kind not in NUMERIC_KINDS or dtype.hasobject or dtype.subdtype is not None:
            raise damaged(path, "arrays.npz", f"{member.filename} has dtype {dtype}, not a number type")
        nbytes = math.prod(shape) * dtype.itemsize
        if f.tell() + nbytes != member.file_size:
            raise damaged(path, "arrays.npz", f"{member.filename} says shape {shape} of {dtype}, which is not its size")
        if record is not None and (record["shape"], record["dtype"]) != (
            list(shape),
            np.lib.format.dtype_to_descr(dtype),
        ):
            raise damaged(path, "arrays.npz", f"{member.filename} is {dtype} {shape}, the manifest says otherwise")
        flat = np.empty(math.prod(shape), dtype=dtype)
        raw = flat.view(np.uint8)
        done = 0
        while done < nbytes:
            chunk = f.read(min(nbytes - done, 1 << 20))
            if not chunk:
                raise damaged(path, "arrays.npz", f"{member.filename} ends early")
            raw[done : done + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            done += len(chunk)
    return flat.reshape(shape[::-1]).transpose() if fortran_order else flat.reshape(shape)
