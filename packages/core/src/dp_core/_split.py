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

from dataclasses import KW_ONLY, dataclass
from typing import Literal, NamedTuple

import numpy as np

from dp_core._batch import _check_positive_int, padded_batch_size


class Shard(NamedTuple):
    """One replica's part of an epoch: sample indices and which of them are real.

    ``indices[i]`` is a valid sample index for every ``i`` (padding repeats samples
    from the start of the epoch, so loaders never see an out-of-range index);
    ``mask[i]`` is False for padding, which must weigh nothing.
    """

    indices: np.ndarray  # int64, shape (num_steps * padded_batch_size // num_shards,)
    mask: np.ndarray  # bool, same shape


Shuffle = bool | Literal["batch"]


def epoch_order(
    num_samples: int, *, seed: int = 0, epoch: int = 0, shuffle: Shuffle = True, batch_size: int | None = None
) -> np.ndarray:
    """The global sample order of one epoch, the same for every replica count.

    ``shuffle="batch"`` is Keras's array adapter's: the rows of each block of ``batch_size``
    (the last one shorter) are shuffled among themselves, and the blocks keep their order.

    Examples:
        >>> epoch_order(5, shuffle=False)
        array([0, 1, 2, 3, 4])
        >>> order = epoch_order(5, shuffle="batch", batch_size=2, seed=1)
        >>> sorted(order[:2].tolist()), sorted(order[2:4].tolist()), order[4:].tolist()
        ([0, 1], [2, 3], [4])
    """
    _check_positive_int("num_samples", num_samples)
    if not isinstance(shuffle, (bool, np.bool_)) and shuffle != "batch":
        raise ValueError(f'shuffle must be True, False or "batch", got {shuffle!r}.')
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}.")
    keys = np.random.PCG64(np.random.SeedSequence([seed, epoch])).random_raw(num_samples)
    if shuffle == "batch":
        if batch_size is None:
            raise ValueError('shuffle="batch" shuffles within blocks of batch_size rows: pass batch_size.')
        _check_positive_int("batch_size", batch_size)
        blocks = np.arange(num_samples) // batch_size
        return np.lexsort((keys, blocks)).astype(np.int64)  # by block, then by key within it
    return np.argsort(keys, kind="stable").astype(np.int64)


@dataclass(frozen=True)
class EpochOrder:
    """Which rows of an array input one epoch reads, in which order, ``global_batch_size`` a step:
    one value for backend authors, built once (``dp_core.keras.FitArguments.epoch_order``) and
    handed to the batch readers. A batch-yielding source reads only ``epoch``, ``seed`` and
    ``shuffles_batches``.

    ``shuffle`` has no default here: a fit passes its own (``model.fit``'s default, True, is the
    default of ``epoch_rows`` and ``split_indices``, which take these fields as keywords), and
    ``in_input_order`` is what ``evaluate`` and ``predict`` read.

    10 rows in batches of 4 (a pass is 3 batches), 2 steps an epoch, a fit begun at epoch 1:
    its second epoch ends the pass, with one short step::

        >>> order = EpochOrder(4, shuffle=False, epoch=2, first_epoch=1, steps_per_epoch=2)
        >>> order.rows(10).tolist(), order.steps(10)
        ([8, 9], 1)
    """

    global_batch_size: int
    shuffle: Shuffle  # True, False or "batch" (``epoch_order``)
    _: KW_ONLY
    seed: int = 0
    epoch: int = 0
    first_epoch: int = 0  # the fit's initial epoch: its pass k is ordered as epoch first_epoch + k
    steps_per_epoch: int | None = None  # None: an epoch is one pass; else passes are cut into epochs

    @classmethod
    def in_input_order(cls, global_batch_size: int) -> EpochOrder:
        """One pass over the rows as they are given: what ``evaluate`` and ``predict`` read."""
        return cls(global_batch_size, shuffle=False)

    @property
    def shuffles_batches(self) -> bool:
        """Whether a batch-yielding source's batch order is shuffled: by any true ``shuffle``
        (``"batch"`` too), as Keras's PyDataset adapter reads it."""
        return bool(self.shuffle)

    def rows(self, num_samples: int) -> np.ndarray:
        """The rows this epoch reads, in order (``epoch_rows``)."""
        passes, start, stop = self._batches(num_samples)
        size = self.global_batch_size
        order = epoch_order(num_samples, seed=self.seed, epoch=passes, shuffle=self.shuffle, batch_size=size)
        return order[start * size : stop * size]

    def steps(self, num_samples: int) -> int:
        """The steps of this epoch: the global batches of its ``rows`` (``epoch_steps``)."""
        _, start, stop = self._batches(num_samples)
        return stop - start

    def shard(self, num_samples: int, *, num_shards: int, shard_index: int, drop_remainder: bool = False) -> Shard:
        """Shard ``shard_index``'s part of this epoch's rows, padded and masked (``split_indices``)."""
        size = self.global_batch_size
        padded = padded_batch_size(size, num_shards)
        if not isinstance(shard_index, int) or not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index!r}.")
        order = self.rows(num_samples)
        steps = num_steps(len(order), size, drop_remainder=drop_remainder)
        within = np.arange(padded)  # a step's positions: its global batch, then padding up to a multiple
        rows = np.arange(steps)[:, None] * size + within  # the epoch's row each position reads
        mask = (within < size) & (rows < len(order))
        parts, cut = (steps, num_shards, padded // num_shards), (slice(None), shard_index)
        mine = rows.reshape(parts)[cut].reshape(-1)
        return Shard(
            indices=order[mine % len(order)],  # padding repeats rows of the epoch: valid, masked out
            mask=mask.reshape(parts)[cut].reshape(-1),
        )

    def _batches(self, num_samples: int) -> tuple[int, int, int]:
        """``(pass key, first batch, end batch)`` of this epoch's part of its pass (``epoch_rows``)."""
        _check_positive_int("global_batch_size", self.global_batch_size)
        epoch, first_epoch, steps_per_epoch = self.epoch, self.first_epoch, self.steps_per_epoch
        if epoch < first_epoch:
            raise ValueError(f"epoch must be >= first_epoch, got epoch={epoch}, first_epoch={first_epoch}.")
        batches = num_steps(num_samples, self.global_batch_size)
        if steps_per_epoch is not None:
            _check_positive_int("steps_per_epoch", steps_per_epoch)
        if steps_per_epoch is None or steps_per_epoch >= batches:
            return epoch, 0, batches
        epochs_a_pass = -(-batches // steps_per_epoch)
        passes, part = divmod(epoch - first_epoch, epochs_a_pass)
        start = part * steps_per_epoch
        return first_epoch + passes, start, min(start + steps_per_epoch, batches)


def epoch_rows(
    num_samples: int,
    global_batch_size: int,
    *,
    epoch: int = 0,
    first_epoch: int = 0,
    steps_per_epoch: int | None = None,
    seed: int = 0,
    shuffle: Shuffle = True,
) -> np.ndarray:
    """The rows epoch ``epoch`` of a fit that began at ``first_epoch`` reads, in order; its steps
    take them ``global_batch_size`` at a time (the last batch of a pass may be short).

    Without ``steps_per_epoch`` an epoch is one pass: ``epoch_order(..., epoch=epoch)``. With
    it, epochs read on where the last one stopped, as Keras's ``EpochIterator`` reads arrays:
    a pass of ``P`` batches (``num_steps``) is cut into epochs of ``steps_per_epoch`` batches;
    the pass's last epoch takes what is left (fewer steps when ``steps_per_epoch`` does not
    divide ``P``, and Keras warns that the input ran out), and the next epoch starts a new
    pass in a new order. ``steps_per_epoch >= P`` is one pass an epoch. Pass ``k`` of the
    fit is ordered by ``epoch_order(..., epoch=first_epoch + k)``, so without cuts every
    epoch keeps its own order. (``EpochOrder.rows`` with these fields.)

    With 10 rows, batches of 4 (a pass is 3 batches) and 2 steps an epoch::

        >>> [epoch_rows(10, 4, epoch=e, steps_per_epoch=2, shuffle=False).tolist() for e in range(3)]
        [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9], [0, 1, 2, 3, 4, 5, 6, 7]]
        >>> epoch_rows(10, 4, epoch=1, steps_per_epoch=5, shuffle=False).tolist()
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    """
    order = EpochOrder(
        global_batch_size, shuffle, seed=seed, epoch=epoch, first_epoch=first_epoch, steps_per_epoch=steps_per_epoch
    )
    return order.rows(num_samples)


def epoch_steps(
    num_samples: int,
    global_batch_size: int,
    *,
    steps_per_epoch: int | None = None,
    epoch: int = 0,
    first_epoch: int = 0,
) -> int:
    """The steps of epoch ``epoch``: the global batches of its ``epoch_rows`` (``EpochOrder.steps``).

    99 rows in batches of 32 (a pass is 4 batches), 3 steps an epoch::

        >>> [epoch_steps(99, 32, epoch=e, steps_per_epoch=3) for e in range(3)]
        [3, 1, 3]
    """
    order = EpochOrder(
        global_batch_size, shuffle=False, epoch=epoch, first_epoch=first_epoch, steps_per_epoch=steps_per_epoch
    )
    return order.steps(num_samples)


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
    shuffle: Shuffle = True,
    drop_remainder: bool = False,
    steps_per_epoch: int | None = None,
    first_epoch: int = 0,
) -> Shard:
    """The indices and mask of shard ``shard_index`` for one epoch.

    Global batch ``b`` is ``order[b*B:(b+1)*B]``, padded up to ``P``, the next multiple of ``R``
    (``padded_batch_size``; ``P = B`` when ``R`` divides it); shard ``r`` of ``R`` takes its
    ``r``-th contiguous part of ``P/R`` rows. The padding, and the last partial batch's missing
    rows, are masked, so every shard runs the same number of steps and every real row counts
    once. The epoch's rows are ``epoch_rows`` (all of them unless ``steps_per_epoch`` cuts
    passes into epochs).

    With 10 samples, a global batch of 4 and no shuffling::

        shard 0: indices [0 1 4 5 8 9]  mask [T T T T T T]
        shard 1: indices [2 3 6 7 0 1]  mask [T T T T F F]

    and a global batch of 3 (padded to 4)::

        shard 0: indices [0 1 3 4 6 7 9 0]  mask [T T T T T T T F]
        shard 1: indices [2 3 5 6 8 9 1 2]  mask [T F T F T F F F]
    """
    order = EpochOrder(
        global_batch_size, shuffle, seed=seed, epoch=epoch, first_epoch=first_epoch, steps_per_epoch=steps_per_epoch
    )
    return order.shard(num_samples, num_shards=num_shards, shard_index=shard_index, drop_remainder=drop_remainder)
