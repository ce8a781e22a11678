"""``load_weights`` inside ``torch_dp.Trainer.scope()``, before the model's first call: a variable is
given where its value lies in the file (``StoredValue``: the file, the dataset's name), not the value,
so loading a model bigger than one replica reads nothing yet. At the first call each replica reads its
own part of each variable from the file, the rows it holds (h5py reads that slice only), and nothing
else (``_scope.materialize``). A value whose file cannot be opened again (the weights inside a
``.keras`` archive, which Keras reads through the zip member) is read whole once, one variable at a
time, and written to a temporary h5 file in ``TMPDIR`` (``_Spill``), which the replicas then read by
parts as any other: so no process keeps the model whole. The file is removed once the caller holds no
value of it."""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import weakref
from typing import Any

import h5py
import ml_dtypes
import numpy as np


class _Spill:
    """A temporary h5 file of values read from files that cannot be opened again, removed when no
    ``StoredValue`` of the caller's refers to it (a worker's copy does not hold it: ``__getstate__``)."""

    def __init__(self) -> None:
        descriptor, self.path = tempfile.mkstemp(prefix="torch-dp-loaded-", suffix=".h5")
        os.close(descriptor)
        with h5py.File(self.path, "w"):
            pass
        self._names = itertools.count()
        weakref.finalize(self, _remove, self.path)

    def add(self, values: np.ndarray) -> str:
        name = f"v{next(self._names)}"
        with h5py.File(self.path, "a") as file:
            file.create_dataset(name, data=values)
        return name


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


_spill: weakref.ReferenceType[_Spill] | None = None  # the caller's current one, while a value refers to it


class StoredValue:
    """A variable's value in an h5 weights file, read when it is needed (``__array__``). ``bfloat16``:
    Keras stored it as 2-byte opaque values marked ``dtype="bfloat16"``. ``spill``: the temporary file
    it lies in, kept while this value is (the caller's only)."""

    def __init__(
        self,
        filename: str,
        name: str,
        shape: tuple[int, ...],
        dtype: np.dtype,
        *,
        bfloat16: bool,
        spill: _Spill | None = None,
    ) -> None:
        self.filename, self.name, self.bfloat16 = filename, name, bfloat16
        self.shape, self.dtype = shape, dtype
        self.spill = spill
        self.temporary = spill is not None  # known to the workers too: the caller waits for their reads

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "spill": None}

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        values = self.read(None)
        return values if dtype is None else values.astype(dtype, copy=False)

    def read(self, rows: tuple[int, int] | None) -> np.ndarray:
        """The value, or its rows ``rows[0]:rows[1]`` of dimension 0 only (read from the file as a slice)."""
        with h5py.File(self.filename, "r") as file:
            dataset: Any = file[self.name]
            values = np.asarray(dataset if rows is None else dataset[rows[0] : rows[1]])
        return values.view(ml_dtypes.bfloat16) if self.bfloat16 else values

    def read_part(self, axis: int, start: int, stop: int) -> np.ndarray:
        """The value's ``start:stop`` along ``axis`` only (read from the file as a slice): a mesh's part."""
        index = (*([slice(None)] * axis), slice(start, stop))
        with h5py.File(self.filename, "r") as file:
            dataset: Any = file[self.name]
            values = np.asarray(dataset[index])
        return values.view(ml_dtypes.bfloat16) if self.bfloat16 else values


def stored(dataset: Any, bfloat16: bool) -> StoredValue:
    """What ``load_weights`` assigns in a scope: where ``dataset``'s value lies (in a temporary file of
    the caller's, where its own file is not on disk)."""
    global _spill
    filename = dataset.file.filename
    dtype = np.dtype(ml_dtypes.bfloat16) if bfloat16 else np.dtype(dataset.dtype)
    if isinstance(filename, str) and os.path.isfile(filename):
        return StoredValue(filename, dataset.name, tuple(dataset.shape), dtype, bfloat16=bfloat16)
    spill = _spill() if _spill is not None else None
    if spill is None:
        spill = _Spill()
        _spill = weakref.ref(spill)
    values = np.asarray(dataset)  # one variable whole, as Keras reads it, dropped once written
    name = spill.add(values.view(np.uint16) if bfloat16 else values)
    return StoredValue(spill.path, name, tuple(dataset.shape), dtype, bfloat16=bfloat16, spill=spill)
