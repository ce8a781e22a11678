"""``load_weights`` inside ``torch_dp.Trainer.scope()``, before the model's first call: a variable is
given where its value lies in the file (``StoredValue``: the file, the dataset's name), not the value,
so loading a model bigger than one replica reads nothing yet. At the first call each replica reads its
own part of each variable from the file, the rows it holds (h5py reads that slice only), and nothing
else (``_scope.materialize``). A value whose file cannot be opened again (the weights inside a
``.keras`` archive, which Keras reads from memory) is read whole at once, as Keras reads it, and rank 0
sends each replica its part, as it does an initializer's value."""

from __future__ import annotations

import os
from typing import Any

import h5py
import ml_dtypes
import numpy as np


class StoredValue:
    """A variable's value in an h5 weights file, read when it is needed (``__array__``). ``bfloat16``:
    Keras stored it as 2-byte opaque values marked ``dtype="bfloat16"``."""

    def __init__(self, filename: str, name: str, shape: tuple[int, ...], dtype: np.dtype, *, bfloat16: bool) -> None:
        self.filename, self.name, self.bfloat16 = filename, name, bfloat16
        self.shape, self.dtype = shape, dtype

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        values = self.read(None)
        return values if dtype is None else values.astype(dtype, copy=False)

    def read(self, rows: tuple[int, int] | None) -> np.ndarray:
        """The value, or its rows ``rows[0]:rows[1]`` of dimension 0 only (read from the file as a slice)."""
        with h5py.File(self.filename, "r") as file:
            dataset: Any = file[self.name]
            values = np.asarray(dataset if rows is None else dataset[rows[0] : rows[1]])
        return values.view(ml_dtypes.bfloat16) if self.bfloat16 else values


def stored(dataset: Any, bfloat16: bool) -> Any:
    """What ``load_weights`` assigns in a scope: where ``dataset`` lies (its value, where its file is not on disk)."""
    filename = dataset.file.filename
    if not isinstance(filename, str) or not os.path.isfile(filename):
        values = np.asarray(dataset)
        return values.view(ml_dtypes.bfloat16) if bfloat16 else values
    dtype = np.dtype(ml_dtypes.bfloat16) if bfloat16 else np.dtype(dataset.dtype)
    return StoredValue(filename, dataset.name, tuple(dataset.shape), dtype, bfloat16=bfloat16)
