"""One epoch of a batch-yielding input (PyDataset, generator, DataLoader, tf.data, grain) as
global batches on the mesh.

Every process reads each global batch once and keeps the rows of its own replicas
(``dp_core.keras.replica_part``), so the batch is split exactly as an array input's global
batch is; a short batch is padded and masked. The step count may be unknown in advance.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from dp_core import EpochOrder, ReplicaLayout
from dp_core.keras import BatchSource, Inputs, batch_rows, padded_batch_size, replica_part
from jax_dp._data.batches import EpochPlan, HostBatch, Plan, all_replicas_local


def epoch_plan(inputs: Inputs | BatchSource, *, layout: ReplicaLayout, order: EpochOrder) -> Plan:
    """The plan of one epoch: of ``order``'s rows, or of a source's batches (epoch ``order.epoch``)."""
    if isinstance(inputs, BatchSource):
        return SourcePlan(inputs, layout=layout, order=order)
    return EpochPlan(inputs, layout=layout, order=order)


class SourcePlan:
    """The global batches of one epoch of ``source``, read as they are needed."""

    padded = True  # any batch may be short, so the steps always leave padded rows out

    def __init__(self, source: BatchSource, *, layout: ReplicaLayout, order: EpochOrder) -> None:
        self.inputs = source
        self.source_batch_size = order.global_batch_size
        self.global_batch_size = padded_batch_size(order.global_batch_size, layout.num_replicas)  # what the mesh holds
        self.steps = source.num_batches
        self._layout = layout
        self._order = order
        self._real_rows: list[int] = []

    def real_rows(self, step: int) -> int:
        """Real rows of global batch ``step`` (read already)."""
        return self._real_rows[step]

    def every_replica(self) -> SourcePlan:
        """This epoch as one process driving every replica reads it (before it is read): whole batches."""
        if self._layout.num_processes == 1:
            return self
        return SourcePlan(self.inputs, layout=all_replicas_local(self._layout), order=self._order)

    def host_batches(self, start: int = 0) -> Iterator[HostBatch]:
        """This process's rows of every global batch from ``start`` (earlier ones are read and skipped)."""
        replicas = self._layout.local_replica_indices
        order = self._order
        for step, batch in enumerate(self.inputs.epoch(order.epoch, shuffle=order.shuffles_batches, seed=order.seed)):
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
