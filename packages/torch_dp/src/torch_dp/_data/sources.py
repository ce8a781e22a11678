"""Where a call's rows come from (``Readable``): arrays (``Inputs``), a batch-yielding input
(``BatchSource``: a PyDataset, generator, DataLoader...), or, in a worker replica, the stand-in for
one (``SourceOnPrimary``). A batch-yielding input is read by rank 0 alone, once per global batch,
and each batch broadcast (``global_batches``); every replica then keeps its own rows (``_data.batches``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dp_core import EpochOrder, num_steps
from dp_core.keras import BatchSource, Inputs, map_structure
from torch_dp._comm.replica import Replica


@dataclass(frozen=True)
class SourceOnPrimary:
    """A worker's stand-in for a batch-yielding input, which rank 0 alone reads (once per global
    batch) and broadcasts: its first rows, to build the model, and its batches per epoch."""

    first: tuple[Any, Any, Any]
    num_batches: int | None

    def first_rows(self, count: int = 2) -> tuple[Any, Any, Any]:
        x, y, sample_weight = (map_structure(lambda leaf: leaf[:count], part) for part in self.first)
        return x, y, sample_weight


Readable = Inputs | BatchSource | SourceOnPrimary


def steps_of(inputs: Readable, global_batch_size: int) -> int | None:
    """Global batches an epoch (None: a source that does not say)."""
    if isinstance(inputs, Inputs):
        return num_steps(inputs.num_samples, global_batch_size)
    return inputs.num_batches


def global_batches(
    source: BatchSource | SourceOnPrimary, replica: Replica, order: EpochOrder, first_step: int
) -> Iterator[tuple[Any, Any, Any]]:
    """A source's whole global batches of epoch ``order.epoch`` from ``first_step`` on, read by rank 0
    and broadcast (``None`` ends the epoch)."""
    if isinstance(source, BatchSource):
        batches: Iterator[Any] = source.epoch(order.epoch, shuffle=order.shuffles_batches, seed=order.seed)
        for step, batch in enumerate(batches):
            if step >= first_step:
                yield _shared_from_primary(batch, replica)
        _shared_from_primary(None, replica)
        return
    while (batch := _shared_from_primary(None, replica)) is not None:
        yield batch


def _shared_from_primary(batch: Any, replica: Replica) -> Any:
    """Rank 0's ``batch`` on every replica (numpy arrays, pickled: rank 0's own data), and rank 0's torch
    generator: its reading drew what Keras's loader draws (``_loop.loader_draws``), before any step's draw."""
    if not replica.distributed:
        return batch
    message = [batch, torch.get_rng_state()]
    dist.broadcast_object_list(message, src=0, group=replica.group)
    torch.set_rng_state(message[1])
    return message[0]
