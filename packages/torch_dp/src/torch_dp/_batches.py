"""What each replica feeds its model at each step, and how arrays reach the workers.

Arrays handed to ``fit`` are written once to ``.npy`` files and memory-mapped by every
worker, so N workers share one copy through the page cache instead of unpickling N.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import keras
import numpy as np
import torch

from dp_core import num_steps, split_indices
from dp_core._data import flatten, is_array_like, is_map_dataset, map_structure, num_rows, take_rows
from torch_dp._comm import Replica


@dataclass(frozen=True)
class SharedArray:
    """A placeholder for an array leaf saved to ``path``; workers map it read-only."""

    path: str


@dataclass(frozen=True)
class Data:
    """``x``, ``y`` and ``sample_weight`` as ``fit`` got them (or a map-style dataset as ``x``)."""

    x: Any
    y: Any = None
    sample_weight: Any = None

    @property
    def num_samples(self) -> int:
        return num_rows(self.x, self.y, self.sample_weight)


def share(data: Data, directory: str, name: str) -> Data:
    """``data`` with every array leaf saved under ``directory`` and replaced by a ``SharedArray``."""
    counter = iter(range(1 << 30))

    def save(leaf: Any) -> Any:
        if not is_array_like(leaf):
            return leaf
        path = os.path.join(directory, f"{name}_{next(counter)}.npy")
        array = leaf.detach().cpu().numpy() if isinstance(leaf, torch.Tensor) else np.asarray(leaf)
        np.save(path, array, allow_pickle=False)
        return SharedArray(path)

    if is_map_dataset(data.x):
        return data  # datasets travel by pickling; torch tensors inside go to shared memory
    return Data(*(map_structure(save, part) for part in (data.x, data.y, data.sample_weight)))


def open_shared(data: Data) -> Data:
    """``data`` with each ``SharedArray`` memory-mapped (no copy until rows are read)."""

    def load(leaf: Any) -> Any:
        return np.load(leaf.path, mmap_mode="r", allow_pickle=False) if isinstance(leaf, SharedArray) else leaf

    return Data(*(map_structure(load, part) for part in (data.x, data.y, data.sample_weight)))


@dataclass
class Batch:
    """One replica's rows of one global batch.

    ``real_rows`` real rows come first (padding sits at the end of the global batch, and a
    replica's part is contiguous). ``loss_weight`` makes Keras's mean over this replica's
    rows equal ``num_replicas`` times its share of the mean over the global batch's real
    rows, so averaging gradients over replicas gives the single-device gradient.
    """

    x: Any
    y: Any
    sample_weight: Any
    loss_weight: Any
    mask: torch.Tensor | None  # None when every row of the global batch is real
    real_rows: int
    rows: int
    global_real_rows: int
    global_batch_size: int

    @property
    def partial(self) -> bool:
        return self.global_real_rows < self.global_batch_size


def replica_batches(
    data: Data,
    replica: Replica,
    *,
    global_batch_size: int,
    epoch: int = 0,
    seed: int = 0,
    shuffle: bool = False,
    first_step: int = 0,
) -> Iterator[Batch]:
    """This replica's batches of one epoch from ``first_step`` on; every replica gets the same number."""
    num_samples = data.num_samples
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
        yield _batch(data, shard.indices[part], shard.mask[part], global_real_rows, global_batch_size)


def _batch(data: Data, indices: np.ndarray, mask: np.ndarray, global_real_rows: int, global_batch_size: int) -> Batch:
    if is_map_dataset(data.x):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(take_rows(data.x, indices))
    else:
        x, y, sample_weight = (take_rows(part, indices) for part in (data.x, data.y, data.sample_weight))
    x, y, sample_weight = (map_structure(_to_tensor, part) for part in (x, y, sample_weight))
    real_rows = int(mask.sum())
    loss_weight = sample_weight
    mask_tensor = None
    if global_real_rows < global_batch_size:
        mask_tensor = cast(torch.Tensor, keras.ops.convert_to_tensor(mask.astype(keras.backend.floatx())))
        scaled = mask_tensor * (global_batch_size / global_real_rows)
        loss_weight = (
            scaled if sample_weight is None else map_structure(lambda w: _times_rows(w, scaled), sample_weight)
        )
    return Batch(
        x, y, sample_weight, loss_weight, mask_tensor, real_rows, len(mask), global_real_rows, global_batch_size
    )


def _times_rows(weight: torch.Tensor, row_factor: torch.Tensor) -> torch.Tensor:
    return weight * row_factor.reshape((-1,) + (1,) * (weight.ndim - 1)).to(weight.dtype)


def _to_tensor(leaf: Any) -> Any:
    array = np.asarray(leaf)
    if np.issubdtype(array.dtype, np.floating) and array.dtype != np.dtype(keras.backend.floatx()):
        array = array.astype(keras.backend.floatx())  # as Keras's array adapter does
    return keras.ops.convert_to_tensor(array)


def first_rows(data: Data, count: int = 2) -> tuple[Any, Any, Any]:
    """A few rows as tensors, to build a model and its metrics before training."""
    indices = np.arange(min(count, data.num_samples))
    if is_map_dataset(data.x):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(take_rows(data.x, indices))
    else:
        x, y, sample_weight = (take_rows(part, indices) for part in (data.x, data.y, data.sample_weight))
    return tuple(map_structure(_to_tensor, part) for part in (x, y, sample_weight))  # type: ignore[return-value]


def leaves(data: Data) -> list[Any]:
    return flatten((data.x, data.y, data.sample_weight))
