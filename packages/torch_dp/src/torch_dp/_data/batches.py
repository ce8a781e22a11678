"""What each replica feeds its model at each step. (How arrays reach the worker replicas, written
once and memory-mapped: ``_processes.transfer``.)

On an accelerator, an array input's batches are read one ahead in the background
(``_data.prefetch``): rows are indexed and converted on the host (into pinned memory for a GPU)
while the step before computes, then copied to the replica's device without blocking the host.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import keras
import numpy as np
import torch

from dp_core import EpochOrder, num_steps
from dp_core.keras import (
    BatchSource,
    Inputs,
    map_structure,
    padded_batch_size,
    replica_positions,
    runs_last_batch_whole,
)
from torch_dp._comm.replica import Replica
from torch_dp._data.loaders import replica_rows
from torch_dp._data.prefetch import pinned, pins_memory, prefetched, reads_ahead, to_device
from torch_dp._data.sources import Readable, SourceOnPrimary


@dataclass
class Batch:
    """One replica's rows of one global batch.

    ``real_rows`` real rows come first (padding sits at the end of the global batch, and a
    replica's part is contiguous). ``mask`` (1 for real rows, 0 for padding) is what keeps
    padding out of the loss (``dp_core.keras.replica_losses``), BatchNormalization statistics
    and metrics.

    ``whole``: every replica holds the whole short last batch, unpadded (``runs_last_batch_whole``),
    and computes ``model.fit``'s step on it; its gradient and metrics count once.
    """

    x: Any
    y: Any
    sample_weight: Any
    mask: torch.Tensor | None  # None when every row of the global batch is real
    real_rows: int
    rows: int
    global_real_rows: int
    global_batch_size: int
    whole: bool = False

    @property
    def partial(self) -> bool:
        return self.global_real_rows < self.global_batch_size


def whole_last_batch(
    model: keras.Model, inputs: Readable, order: EpochOrder, replica: Replica, *, training: bool = True
) -> bool:
    """Whether ``replica_batches`` should hand every replica a short batch whole: the model computes a
    term over the batch (``dp_core.keras.runs_last_batch_whole``). A global batch that does not divide
    over the replicas makes every batch short of its padded size, so every one may go whole."""
    rows = inputs if isinstance(inputs, Inputs) else None
    num_samples = None if rows is None else rows.num_samples
    global_batch_size = order.global_batch_size
    if padded_batch_size(global_batch_size, replica.num_replicas) != global_batch_size:
        num_samples = None  # not only the last batch is padded: ask as for an input of unknown length
    return runs_last_batch_whole(
        model, rows, num_samples=num_samples, global_batch_size=global_batch_size, training=training
    )


def replica_batches(
    inputs: Readable,
    replica: Replica,
    order: EpochOrder,
    *,
    first_step: int = 0,
    prefetch: bool | None = None,
    whole_last: bool = False,
) -> Iterator[Batch]:
    """This replica's batches of one epoch from ``first_step`` on; every replica gets the same number.
    An array input's epoch reads ``order``'s rows, each global batch padded up to a multiple of the
    replicas (``dp_core.padded_batch_size``). With ``prefetch`` (None: on an accelerator,
    ``reads_ahead``) an array input's next batch is read in the background (the same batches). With
    ``whole_last``, a short batch (padded) is the whole one on every replica (``Batch.whole``)."""
    if prefetch is None:
        prefetch = reads_ahead(replica.device)
    if not isinstance(inputs, Inputs):
        yield from _source_batches(inputs, replica, order, first_step, whole_last)
        return
    global_batch_size = order.global_batch_size
    padded = padded_batch_size(global_batch_size, replica.num_replicas)
    shard = order.shard(inputs.num_samples, num_shards=replica.num_replicas, shard_index=replica.rank)
    this_epoch = order.rows(inputs.num_samples)
    num_samples = len(this_epoch)
    rows = padded // replica.num_replicas
    # a batch read ahead is converted in the reading thread (pinned for a GPU); else once, when placed
    host = functools.partial(_host_tensors, pin=pins_memory(replica.device)) if prefetch else _as_read
    read_rows = _row_reader(inputs)

    def read() -> Iterator[Batch]:
        for step in range(first_step, num_steps(num_samples, global_batch_size)):
            part = slice(step * rows, (step + 1) * rows)
            global_real_rows = min(global_batch_size, num_samples - step * global_batch_size)
            if whole_last and global_real_rows < padded:
                indices = this_epoch[step * global_batch_size : (step + 1) * global_batch_size]
                yield _batch(
                    read_rows, indices, np.ones(len(indices)), len(indices), len(indices), host=host, whole=True
                )
                continue
            yield _batch(read_rows, shard.indices[part], shard.mask[part], global_real_rows, padded, host=host)

    for batch in prefetched(read()) if prefetch else read():
        yield _placed(batch, replica.device)


def _source_batches(
    source: BatchSource | SourceOnPrimary, replica: Replica, order: EpochOrder, first_step: int, whole_last: bool
) -> Iterator[Batch]:
    """A source's global batches, each replica keeping its contiguous part, padded and masked
    as an array input's; with ``whole_last`` a short one (padded) whole."""
    global_batch_size = order.global_batch_size
    padded = padded_batch_size(global_batch_size, replica.num_replicas)

    def rule(real: int) -> tuple[np.ndarray, np.ndarray]:
        if whole_last and real < padded:
            return np.arange(real), np.ones(real, dtype=bool)
        mine, count = range(replica.rank, replica.rank + 1), replica.num_replicas
        return replica_positions(real, global_batch_size=global_batch_size, replicas=mine, num_replicas=count)

    for part, mask, real in replica_rows(source, replica, order, first_step=first_step, rule=rule):
        x, y, sample_weight = (map_structure(keras.ops.convert_to_tensor, piece) for piece in part)
        if whole_last and real < padded:
            yield Batch(x, y, sample_weight, None, real, real, real, real, whole=True)
            continue
        mask_tensor = None
        if real < padded:
            mask_tensor = cast(torch.Tensor, keras.ops.convert_to_tensor(mask.astype(keras.backend.floatx())))
        yield Batch(x, y, sample_weight, mask_tensor, int(mask.sum()), len(mask), real, padded)


def _row_reader(inputs: Inputs) -> Callable[[np.ndarray], Any]:
    """How a batch's rows are read: arrays that Keras would hand a step unchanged are indexed as CPU
    tensors sharing their memory (made once, as Keras's torch adapter converts its arrays once: no
    conversion per batch), anything else through ``Inputs.rows``."""
    arrays = (inputs.x, inputs.y, inputs.sample_weight)
    if not inputs.rows_as_stored() or not all(a.flags.writeable for a in inputs.array_leaves()):
        return inputs.rows  # torch refuses to share a read-only array's memory without a copy
    tensors = map_structure(torch.from_numpy, arrays)

    def read(indices: np.ndarray) -> Any:
        rows = torch.from_numpy(indices)
        return map_structure(lambda tensor: tensor[rows], tensors)

    return read


def _batch(
    read_rows: Callable[[np.ndarray], Any],
    indices: np.ndarray,
    mask: np.ndarray,
    global_real_rows: int,
    global_batch_size: int,
    *,
    host: Callable[[Any], Any],
    whole: bool = False,
) -> Batch:
    """The rows at ``indices`` as ``host`` gives them (host tensors, or numpy); ``_placed`` puts them on the
    replica's device."""
    x, y, sample_weight = host(read_rows(indices))
    real_rows, mask_tensor = len(mask), None  # a full global batch is real throughout
    if global_real_rows < global_batch_size:
        real_rows, mask_tensor = int(mask.sum()), host(mask.astype(keras.backend.floatx()))
    return Batch(x, y, sample_weight, mask_tensor, real_rows, len(mask), global_real_rows, global_batch_size, whole)


def _as_read(structure: Any) -> Any:
    """Rows left as read (numpy, or tensors of the arrays): converted once, on the replica's device (``_placed``)."""
    return structure


def _host_tensors(structure: Any, *, pin: bool = False) -> Any:
    """``structure``'s arrays as CPU tensors, converted as Keras converts them (dtypes included),
    copied into pinned memory when ``pin``. Keras's device is per thread: this one's is the CPU."""
    with keras.device("cpu"):
        tensors = map_structure(keras.ops.convert_to_tensor, structure)
    return pinned(tensors) if pin else tensors


def _on_device(structure: Any, device: str) -> Any:
    """Host tensors on ``device`` (from pinned memory without blocking), then where Keras puts a
    converted input (the same device, unless the caller chose another with ``keras.device``)."""
    return map_structure(keras.ops.convert_to_tensor, to_device(structure, device))


def _placed(batch: Batch, device: str) -> Batch:
    x, y, sample_weight, mask = _on_device((batch.x, batch.y, batch.sample_weight, batch.mask), device)
    return dataclasses.replace(batch, x=x, y=y, sample_weight=sample_weight, mask=mask)


@dataclass
class EvenBatch:
    """One replica's rows of one global batch for a model's own step (``train_step`` and the
    others overridden): never padded, since a user's step cannot be told to ignore rows.

    The global batch's ``global_real_rows`` rows are split as evenly as possible, in order
    (``even_part``). ``weight`` (``rows * num_replicas / global_real_rows``, 1 on a full batch)
    is what this replica's gradients and scalar metric updates count for, so that their mean
    over replicas is the global batch's. A replica left without rows (fewer rows than
    replicas) runs the step on a copy of the batch's first row, with weight 0.
    """

    data: Any  # (x, y, sample_weight) packed as Keras hands a batch to a step
    rows: int  # 0: ``data`` holds a copy of one real row that must weigh nothing
    global_real_rows: int
    num_replicas: int

    @property
    def weight(self) -> float:
        return self.rows * self.num_replicas / self.global_real_rows


def even_part(global_real_rows: int, num_replicas: int, rank: int) -> tuple[int, int]:
    """``(start, count)`` of replica ``rank``'s rows of a global batch: counts differ by at most
    one, the first replicas taking one more, in order.

    >>> [even_part(3, 2, rank) for rank in range(2)]
    [(0, 2), (2, 1)]
    >>> [even_part(1, 2, rank) for rank in range(2)]
    [(0, 1), (1, 0)]
    """
    base, extra = divmod(global_real_rows, num_replicas)
    return rank * base + min(rank, extra), base + int(rank < extra)


def even_batches(
    inputs: Readable, replica: Replica, order: EpochOrder, *, first_step: int = 0, prefetch: bool | None = None
) -> Iterator[EvenBatch]:
    """This replica's ``EvenBatch`` of each global batch of one epoch from ``first_step`` on
    (the same global batches, in the same order, as ``replica_batches``, read ahead likewise)."""
    if prefetch is None:
        prefetch = reads_ahead(replica.device)
    if not isinstance(inputs, Inputs):

        def rule(real: int) -> tuple[np.ndarray, np.ndarray]:
            start, count = even_part(real, replica.num_replicas, replica.rank)
            if count == 0:  # fewer rows than replicas: a copy of the first, weighing nothing
                return np.zeros(1, dtype=int), np.zeros(1, dtype=bool)
            return np.arange(start, start + count), np.ones(count, dtype=bool)

        for part, mask, real in replica_rows(inputs, replica, order, first_step=first_step, rule=rule):
            yield _even_batch(part, int(mask.sum()), real, replica)
        return
    rows, global_batch_size = order.rows(inputs.num_samples), order.global_batch_size
    pin = prefetch and pins_memory(replica.device)

    def read() -> Iterator[tuple[Any, int, int]]:
        for step in range(first_step, num_steps(len(rows), global_batch_size)):
            indices = rows[step * global_batch_size : (step + 1) * global_batch_size]
            start, count = even_part(len(indices), replica.num_replicas, replica.rank)
            mine = indices[start : start + count] if count else indices[:1]
            yield _host_tensors(inputs.rows(mine), pin=pin), count, len(indices)

    for part, count, global_real_rows in prefetched(read()) if prefetch else read():
        yield _even_batch(_on_device(part, replica.device), count, global_real_rows, replica)


def _even_batch(part: tuple[Any, Any, Any], rows: int, global_real_rows: int, replica: Replica) -> EvenBatch:
    x, y, sample_weight = (map_structure(keras.ops.convert_to_tensor, piece) for piece in part)  # no-op on tensors
    data = keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
    return EvenBatch(data, rows, global_real_rows, replica.num_replicas)
