"""``load_weights`` inside a trainer's ``scope()``: each device's part of a variable is read from the
file, never the whole variable.

Keras reads a ``.weights.h5`` (also the one inside a ``.keras`` file, and a keras-hub preset's) as
``store[key]``, a whole numpy array, then ``variable.assign(value)``. Inside a trainer's scope the
store answers a ``StoredArray`` instead (``dp_core.keras.internals.install_keras_file_hooks``): the h5py
dataset, read a part at a time. Assigned to a variable on a trainer's mesh, each distinct part its
sharding gives this process's devices is read once (``h5py``'s ``dataset[index]``) and put on the
devices that hold it (``placed_value``); anything else that asks for the array (a variable placed by
another rule, a layer that computes on the stored value) gets it whole, as Keras reads it.
"""

from __future__ import annotations

from typing import Any

import jax
import keras
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding


class StoredArray:
    """A variable's value in an open h5 file (``dataset``, an ``h5py.Dataset``), read by parts.
    ``bfloat16``: Keras stored it as 2-byte opaque values marked ``dtype="bfloat16"``."""

    def __init__(self, dataset: Any, *, bfloat16: bool) -> None:
        self.dataset = dataset
        self.bfloat16 = bfloat16
        self.shape: tuple[int, ...] = tuple(dataset.shape)
        self.dtype = np.dtype(ml_dtypes.bfloat16) if bfloat16 else np.dtype(dataset.dtype)
        self.ndim = len(self.shape)

    def part(self, index: tuple[slice, ...]) -> np.ndarray:
        """The values at ``index`` (one slice per dimension), read from the file: only those bytes."""
        values = np.asarray(self.dataset[index])
        return values.view(ml_dtypes.bfloat16) if self.bfloat16 else values

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self.part(())  # asked for the whole value (not a placed variable): as Keras reads it
        return whole if dtype is None else whole.astype(dtype, copy=False)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> np.ndarray:
        return self.part(index)


def placed_value(stored: StoredArray, sharding: NamedSharding, dtype: Any) -> jax.Array:
    """``stored`` as a ``jax.Array`` with ``sharding``, in ``dtype`` (the variable's): each distinct
    part this process's devices hold read from the file once and put on its first device, copied
    from there device to device for the others (a replicated axis). The host holds one part at a time."""
    numpy_dtype = np.dtype(keras.backend.standardize_dtype(dtype)) if dtype is not None else stored.dtype
    arrays, first = [], {}
    for device, found in sharding.addressable_devices_indices_map(stored.shape).items():
        index: tuple[slice, ...] = tuple(found or ())  # one slice per dimension
        key = tuple(part.indices(size) for part, size in zip(index, stored.shape, strict=True))
        if key in first:
            arrays.append(jax.device_put(first[key], device))
            continue
        host = stored.part(index).astype(numpy_dtype, copy=False)
        first[key] = jax.device_put(host, device)
        del host  # the next part's read may take its place
        arrays.append(first[key])
    return jax.make_array_from_single_device_arrays(stored.shape, sharding, arrays)
