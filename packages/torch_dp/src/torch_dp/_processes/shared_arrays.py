"""The caller's arrays as the worker replicas read them. Arrays handed to ``fit`` are written
once to ``.npy`` files and memory-mapped by every worker replica (``SharedArrays``,
``open_shared``), so the workers share one copy through the page cache instead of unpickling one
each; the caller (rank 0) reads its own arrays. A memory map of the caller's own travels as the
file it maps (``MappedFile``). A dtype a ``.npy`` file cannot name (ml_dtypes' ``bfloat16``,
float8s) travels beside the file and is viewed again when the file is mapped."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dp_core.keras import Inputs


@dataclass(frozen=True)
class SharedArray:
    """A placeholder for an array leaf saved to ``path``; workers map it read-only."""

    path: str
    dtype: np.dtype | None = None  # one a .npy file cannot name (ml_dtypes' bfloat16 reads back as raw bytes)


@dataclass(frozen=True)
class MappedFile:
    """A caller's memory map of a whole file region, which the workers map read-only in turn
    (a ``np.memmap`` opened ``"r"`` or ``"r+"``, or ``np.load(..., mmap_mode=...)``): a
    dataset larger than memory is neither copied nor written again. Its writes are shared
    (``MAP_SHARED``), so the workers see what the caller wrote before each call."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    fortran: bool
    own_dtype: np.dtype | None = None  # one ``dtype``'s string cannot name (``_own_dtype``)

    @classmethod
    def of(cls, leaf: Any) -> MappedFile | None:
        """The file region ``leaf`` maps, when it is a whole contiguous ``np.memmap`` whose
        writes are shared (a slice, or a copy-on-write ``"c"`` map, is copied instead)."""
        if not isinstance(leaf, np.memmap) or leaf.filename is None or getattr(leaf, "mode", None) not in ("r", "r+"):
            return None
        if not isinstance(leaf.base, mmap.mmap) or not (leaf.flags.c_contiguous or leaf.flags.f_contiguous):
            return None  # a view into a larger map: its own offset is not recorded
        whole = len(leaf.base) - (leaf.offset % mmap.ALLOCATIONGRANULARITY)
        if leaf.nbytes != whole and leaf.ndim:  # numpy maps exactly the array's bytes
            return None
        fortran = bool(leaf.flags.f_contiguous and not leaf.flags.c_contiguous)
        path, own = os.fspath(leaf.filename), _own_dtype(leaf)
        return cls(path, leaf.dtype.str, tuple(leaf.shape), int(leaf.offset), fortran, own)

    def open(self) -> np.memmap:
        order = "F" if self.fortran else "C"
        dtype = self.own_dtype if self.own_dtype is not None else np.dtype(self.dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self.offset, shape=self.shape, order=order)


class SharedArrays:
    """The caller's arrays as ``.npy`` files under ``directory``, each written once: a later call
    with the same array (same object, same contents) maps the same file. A file is removed
    when its array is garbage-collected, and with the directory when the replicas close.

    Contents are compared by a digest, so an array changed in place is written again; a
    read-only array (such as a memory map opened ``"r"``) is trusted by identity alone. A file
    that something else removed meanwhile is written again.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._files: dict[int, tuple[weakref.ref[Any] | None, str, str]] = {}
        self._count = 0

    def share(self, inputs: Inputs) -> Inputs:
        """``inputs`` with every array leaf replaced by a ``SharedArray`` (a dataset travels as it is)."""
        return inputs.map_arrays(self._shared)

    def _shared(self, leaf: Any) -> SharedArray | MappedFile:
        mapped = MappedFile.of(leaf)
        if mapped is not None:  # the workers map the same file: nothing to write
            return mapped
        array = leaf.detach().cpu().numpy() if isinstance(leaf, torch.Tensor) else np.asarray(leaf)
        digest = "" if not array.flags.writeable else _digest(array)
        known = self._files.get(id(leaf))
        same = known is not None and known[0] is not None and known[0]() is leaf and known[1] == digest
        if known is not None and same and os.path.exists(known[2]):  # not removed by someone else meanwhile
            return SharedArray(known[2], _own_dtype(array))
        path = os.path.join(self.directory, f"array_{self._count}.npy")
        self._count += 1
        np.save(path, array, allow_pickle=False)
        key = id(leaf)
        try:
            ref: weakref.ref[Any] | None = weakref.ref(leaf, lambda _: self._forget(key, path))
        except TypeError:  # cannot be watched (a plain list): written again at each call
            ref = None
        self._files[key] = (ref, digest, path)
        return SharedArray(path, _own_dtype(array))

    def _forget(self, key: int, path: str) -> None:
        if self._files.get(key, (None, "", ""))[2] == path:
            del self._files[key]
        with contextlib.suppress(OSError):
            os.remove(path)


def _own_dtype(array: np.ndarray) -> np.dtype | None:
    """``array``'s dtype when it is not numpy's own (ml_dtypes' ``bfloat16``, float8s): ``.npy``
    stores those as void bytes of their size, which ``open_shared`` views as the dtype again."""
    return array.dtype if array.dtype.kind == "V" and array.dtype.names is None else None


def _digest(array: np.ndarray) -> str:
    data = np.ascontiguousarray(array)
    contents = hashlib.blake2b(data.reshape(-1).view(np.uint8).data, digest_size=16)
    return f"{data.dtype.str}{data.shape}{contents.hexdigest()}"


def open_shared(inputs: Inputs) -> Inputs:
    """``inputs`` with each ``SharedArray`` memory-mapped (no copy until rows are read)."""

    def load(leaf: Any) -> Any:
        if isinstance(leaf, MappedFile):
            return leaf.open()
        if not isinstance(leaf, SharedArray):
            return leaf
        array = np.load(leaf.path, mmap_mode="r", allow_pickle=False)
        return array if leaf.dtype is None else array.view(leaf.dtype)

    return inputs.map_arrays(load)
