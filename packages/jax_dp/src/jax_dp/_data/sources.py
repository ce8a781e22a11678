"""One epoch of a batch-yielding input (PyDataset, generator, DataLoader, tf.data, grain) as
global batches on the mesh.

Every process reads each global batch once and keeps the rows of its own replicas
(``dp_core.keras.replica_part``), so the batch is split exactly as an array input's global
batch is; a short batch is padded and masked. The step count may be unknown in advance.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from dp_core import ReplicaLayout, Shuffle
from dp_core.keras import BatchSource, Inputs, batch_rows, padded_batch_size, replica_part
from jax_dp._data.batches import EpochPlan, HostBatch, Plan, all_replicas_local


def epoch_plan(
    inputs: Inputs | BatchSource,
    *,
    layout: ReplicaLayout,
    global_batch_size: int,
    epoch: int = 0,
    seed: int = 0,
    shuffle: Shuffle = False,
    first_epoch: int = 0,
    steps_per_epoch: int | None = None,
) -> Plan:
    """The plan of one epoch: of rows (``dp_core.epoch_rows``: ``first_epoch`` and
    ``steps_per_epoch`` say where in which pass), or of a source's batches."""
    options = {
        "layout": layout,
        "global_batch_size": global_batch_size,
        "epoch": epoch,
        "seed": seed,
        "shuffle": shuffle,
    }
    if isinstance(inputs, BatchSource):
        return SourcePlan(inputs, **options)
    return EpochPlan(inputs, **options, first_epoch=first_epoch, steps_per_epoch=steps_per_epoch)


class SourcePlan:
    """The global batches of one epoch of ``source``, read as they are needed."""

    padded = True  # any batch may be short, so the steps always leave padded rows out

    def __init__(
        self,
        source: BatchSource,
        *,
        layout: ReplicaLayout,
        global_batch_size: int,
        epoch: int = 0,
        seed: int = 0,
        shuffle: bool = False,
    ) -> None:
        self.inputs = source
        self.source_batch_size = global_batch_size
        self.global_batch_size = padded_batch_size(global_batch_size, layout.num_replicas)  # what the mesh holds
        self.steps = source.num_batches
        self._layout = layout
        self._epoch, self._seed, self._shuffle = epoch, seed, shuffle
        self._real_rows: list[int] = []

    def real_rows(self, step: int) -> int:
        """Real rows of global batch ``step`` (read already)."""
        return self._real_rows[step]

    def every_replica(self) -> SourcePlan:
        """This epoch as one process driving every replica reads it (before it is read): whole batches."""
        if self._layout.num_processes == 1:
            return self
        return SourcePlan(
            self.inputs,
            layout=all_replicas_local(self._layout),
            global_batch_size=self.source_batch_size,
            epoch=self._epoch,
            seed=self._seed,
            shuffle=self._shuffle,
        )

    def host_batches(self, start: int = 0) -> Iterator[HostBatch]:
        """This process's rows of every global batch from ``start`` (earlier ones are read and skipped)."""
        replicas = self._layout.local_replica_indices
        for step, batch in enumerate(self.inputs.epoch(self._epoch, shuffle=self._shuffle, seed=self._seed)):
            (x, y, sample_weight), mask = replica_part(
                batch,
                global_batch_size=self.source_batch_size,
                replicas=replicas,
                num_replicas=self._layout.num_replicas,
            )
            real = batch_rows(batch)
            self._real_rows.append(real)
            if step >= start:
                yield HostBatch(x, y, sample_weight, mask.astype(np.float32), real)
