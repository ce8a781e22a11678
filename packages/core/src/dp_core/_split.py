"""Splitting one epoch of samples across replicas.

The global order of an epoch depends only on ``(num_samples, seed, epoch, shuffle)``;
the number of shards only decides who gets which contiguous part of each global
batch. That is what lets N replicas train exactly like one, and lets a run resume
on a different replica count with the same data order.

The order comes from 64-bit keys drawn with numpy's PCG64 bit generator, seeded by
``SeedSequence([seed, epoch])``, and sorted with a stable sort. Both the
``SeedSequence`` hashing and PCG64's raw stream are fixed by numpy's compatibility
policy, and sorting is exact, so orders are the same on every platform and release
(``Generator.permutation`` carries no such promise).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dp_core._batch import _check_positive_int, per_replica_batch_size


class Shard(NamedTuple):
    """One replica's part of an epoch: sample indices and which of them are real.

    ``indices[i]`` is a valid sample index for every ``i`` (padding repeats samples
    from the start of the epoch, so loaders never see an out-of-range index);
    ``mask[i]`` is False for padding, which must weigh nothing.
    """

    indices: np.ndarray  # int64, shape (num_steps * per_replica_batch_size,)
    mask: np.ndarray  # bool, same shape


def epoch_order(num_samples: int, *, seed: int = 0, epoch: int = 0, shuffle: bool = True) -> np.ndarray:
    """The global sample order of one epoch, the same for every replica count.

    Examples:
        >>> epoch_order(5, shuffle=False)
        array([0, 1, 2, 3, 4])
    """
    _check_positive_int("num_samples", num_samples)
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}.")
    keys = np.random.PCG64(np.random.SeedSequence([seed, epoch])).random_raw(num_samples)
    return np.argsort(keys, kind="stable").astype(np.int64)


def num_steps(num_samples: int, global_batch_size: int, *, drop_remainder: bool = False) -> int:
    """Steps in one epoch; the last partial batch counts unless ``drop_remainder``."""
    _check_positive_int("num_samples", num_samples)
    _check_positive_int("global_batch_size", global_batch_size)
    if drop_remainder:
        return num_samples // global_batch_size
    return -(-num_samples // global_batch_size)


def split_indices(
    num_samples: int,
    *,
    num_shards: int,
    shard_index: int,
    global_batch_size: int,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    drop_remainder: bool = False,
) -> Shard:
    """The indices and mask of shard ``shard_index`` for one epoch.

    Global batch ``b`` is ``order[b*B:(b+1)*B]``; shard ``r`` of ``R`` takes its
    ``r``-th contiguous part of ``B/R`` rows. The last partial batch is padded to
    ``B`` and masked, so every shard runs the same number of steps.

    With 10 samples, a global batch of 4 and no shuffling::

        shard 0: indices [0 1 4 5 8 9]  mask [T T T T T T]
        shard 1: indices [2 3 6 7 0 1]  mask [T T T T F F]
    """
    batch = per_replica_batch_size(global_batch_size, num_shards)
    if not isinstance(shard_index, int) or not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index!r}.")
    order = epoch_order(num_samples, seed=seed, epoch=epoch, shuffle=shuffle)
    steps = num_steps(num_samples, global_batch_size, drop_remainder=drop_remainder)
    total = steps * global_batch_size
    mask = np.arange(total) < num_samples
    indices = np.resize(order, total)  # repeats from the start: valid, masked out
    cut = (slice(None), shard_index)
    return Shard(
        indices=indices.reshape(steps, num_shards, batch)[cut].reshape(-1),
        mask=mask.reshape(steps, num_shards, batch)[cut].reshape(-1),
    )
