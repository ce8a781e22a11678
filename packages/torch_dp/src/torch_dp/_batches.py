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
from dp_core.keras import Inputs, map_structure
from torch_dp._comm import Replica


@dataclass(frozen=True)
class SharedArray:
    """A placeholder for an array leaf saved to ``path``; workers map it read-only."""

    path: str


def share(inputs: Inputs, directory: str, name: str) -> Inputs:
    """``inputs`` with every array saved under ``directory`` and replaced by a ``SharedArray``
    (a dataset travels by pickling; torch tensors inside it go to shared memory)."""
    counter = iter(range(1 << 30))

    def save(leaf: Any) -> SharedArray:
        path = os.path.join(directory, f"{name}_{next(counter)}.npy")
        array = leaf.detach().cpu().numpy() if isinstance(leaf, torch.Tensor) else np.asarray(leaf)
        np.save(path, array, allow_pickle=False)
        return SharedArray(path)

    return inputs.map_arrays(save)


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
