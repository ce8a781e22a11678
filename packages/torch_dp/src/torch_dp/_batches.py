"""What each replica feeds its model at each step, and how arrays reach the workers.

Arrays handed to ``fit`` are written once to ``.npy`` files and memory-mapped by every
worker replica, so the workers share one copy through the page cache instead of
unpickling one each; the caller (rank 0) reads its own arrays.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import keras
import numpy as np
import torch

from dp_core import num_steps, split_indices
from dp_core.keras import Inputs, map_structure
from torch_dp._comm import Replica


@dataclass(frozen=True)
class SharedArray:
    """A placeholder for an array leaf saved to ``path``; workers map it read-only."""

    path: str


class SharedArrays:
    """The caller's arrays as ``.npy`` files under ``directory``, each written once: a later call
    with the same array (same object, same contents) maps the same file. A file is removed
    when its array is garbage-collected, and with the directory when the replicas close.

    Contents are compared by a digest, so an array changed in place is written again; a
    read-only array (such as a memory map opened ``"r"``) is trusted by identity alone.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._files: dict[int, tuple[weakref.ref[Any] | None, str, str]] = {}
        self._count = 0

    def share(self, inputs: Inputs) -> Inputs:
        """``inputs`` with every array leaf replaced by a ``SharedArray`` (a dataset travels as it is)."""
        return inputs.map_arrays(self._shared)

    def _shared(self, leaf: Any) -> SharedArray:
        array = leaf.detach().cpu().numpy() if isinstance(leaf, torch.Tensor) else np.asarray(leaf)
        digest = "" if not array.flags.writeable else _digest(array)
        known = self._files.get(id(leaf))
        if known is not None and known[0] is not None and known[0]() is leaf and known[1] == digest:
            return SharedArray(known[2])
        path = os.path.join(self.directory, f"array_{self._count}.npy")
        self._count += 1
        np.save(path, array, allow_pickle=False)
        key = id(leaf)
        try:
            ref: weakref.ref[Any] | None = weakref.ref(leaf, lambda _: self._forget(key, path))
        except TypeError:  # cannot be watched (a plain list): written again at each call
            ref = None
        self._files[key] = (ref, digest, path)
        return SharedArray(path)

    def _forget(self, key: int, path: str) -> None:
        if self._files.get(key, (None, "", ""))[2] == path:
            del self._files[key]
        with contextlib.suppress(OSError):
            os.remove(path)


def _digest(array: np.ndarray) -> str:
    data = np.ascontiguousarray(array)
    contents = hashlib.blake2b(data.reshape(-1).view(np.uint8).data, digest_size=16)
    return f"{data.dtype.str}{data.shape}{contents.hexdigest()}"


def open_shared(inputs: Inputs) -> Inputs:
    """``inputs`` with each ``SharedArray`` memory-mapped (no copy until rows are read)."""

    def load(leaf: Any) -> Any:
        return np.load(leaf.path, mmap_mode="r", allow_pickle=False) if isinstance(leaf, SharedArray) else leaf

    return inputs.map_arrays(load)


@dataclass
class Batch:
    """One replica's rows of one global batch.

    ``real_rows`` real rows come first (padding sits at the end of the global batch, and a
    replica's part is contiguous). ``mask`` (1 for real rows, 0 for padding) is what keeps
    padding out of the loss (``dp_core.keras.replica_losses``), BatchNormalization statistics
    and metrics.
    """

    x: Any
    y: Any
    sample_weight: Any
    mask: torch.Tensor | None  # None when every row of the global batch is real
    real_rows: int
    rows: int
    global_real_rows: int
    global_batch_size: int

    @property
    def partial(self) -> bool:
        return self.global_real_rows < self.global_batch_size


def replica_batches(
    inputs: Inputs,
    replica: Replica,
    *,
    global_batch_size: int,
    epoch: int = 0,
    seed: int = 0,
    shuffle: bool = False,
    first_step: int = 0,
) -> Iterator[Batch]:
    """This replica's batches of one epoch from ``first_step`` on; every replica gets the same number."""
    num_samples = inputs.num_samples
    shard = split_indices(
        num_samples,
        num_shards=replica.num_replicas,
        shard_index=replica.rank,
        global_batch_size=global_batch_size,
        seed=seed,
        epoch=epoch,
        shuffle=shuffle,
    )
    rows = global_batch_size // replica.num_replicas
    for step in range(first_step, num_steps(num_samples, global_batch_size)):
        part = slice(step * rows, (step + 1) * rows)
        global_real_rows = min(global_batch_size, num_samples - step * global_batch_size)
        yield _batch(inputs, shard.indices[part], shard.mask[part], global_real_rows, global_batch_size)


def _batch(
    inputs: Inputs, indices: np.ndarray, mask: np.ndarray, global_real_rows: int, global_batch_size: int
) -> Batch:
    x, y, sample_weight = (map_structure(keras.ops.convert_to_tensor, part) for part in inputs.rows(indices))
    real_rows = int(mask.sum())
    mask_tensor = None
    if global_real_rows < global_batch_size:
        mask_tensor = cast(torch.Tensor, keras.ops.convert_to_tensor(mask.astype(keras.backend.floatx())))
    return Batch(x, y, sample_weight, mask_tensor, real_rows, len(mask), global_real_rows, global_batch_size)
