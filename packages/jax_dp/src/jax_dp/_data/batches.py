"""Global batches on the mesh, prepared on the host while the devices compute.

Each process gathers only the rows of its own replicas (dp_core.split_indices per
local replica, concatenated in replica order) and hands them to
``jax.make_array_from_process_local_data``; the result is one batch-sharded global
array per input leaf, plus the padding mask.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dp_core import EpochOrder, ReplicaLayout, padded_batch_size
from dp_core.keras import BatchSource, Inputs, map_structure, runs_last_batch_whole
from jax_dp._mesh.mesh import BATCH_AXIS, batch_sharded, put_replicated, replicated

PREFETCH = 2  # batches prepared ahead: enough to hide the host's gather behind a step


class Batch(NamedTuple):
    """One global batch as device arrays; ``mask`` is 1.0 for real rows, 0.0 for padding.

    ``real_rows`` (replicated scalar) counts the real rows of the whole global batch. The
    host knows it, so the step needs no cross-device sum of the mask to weigh the loss.
    """

    x: Any
    y: Any
    sample_weight: Any
    mask: jax.Array
    real_rows: jax.Array


class WholeBatch(Batch):
    """A short batch (the epoch's last, or any when the global batch does not divide over the
    replicas), unpadded and whole on every device (replicated), for a model that computes a term
    over the batch (``dp_core.keras.runs_last_batch_whole``): every device runs ``model.fit``'s
    step on it. Its own pytree type, so a step traced for it (once a shape) knows it from the
    type; ``mask`` is all ones."""


def row_weights(batch: Batch, *, scale_to_real_rows: bool) -> Any:
    """``sample_weight * mask``, times ``B / real_rows`` for the loss (see ``_step.steps``)."""
    weights = batch.mask
    if scale_to_real_rows:
        weights = weights * (batch.mask.shape[0] / batch.real_rows)
    if batch.sample_weight is None:
        return weights

    def weigh(sample_weight: Any) -> Any:
        return sample_weight * jnp.reshape(weights, (-1,) + (1,) * (sample_weight.ndim - 1))

    return map_structure(weigh, batch.sample_weight)


class EpochPlan:
    """This process's rows for every step of one epoch (``order``'s), in replica order."""

    def __init__(self, inputs: Inputs, *, layout: ReplicaLayout, order: EpochOrder) -> None:
        self.inputs = inputs
        self.unpadded_batch_size = order.global_batch_size  # the rows of a global batch, as model.fit's
        # what the mesh holds: a global batch that does not divide over the replicas is padded up to a multiple
        self.global_batch_size = padded_batch_size(order.global_batch_size, layout.num_replicas)
        self._layout = layout
        self._order = order
        self.num_samples = len(order.rows(inputs.num_samples))  # this epoch's
        self.steps = order.steps(inputs.num_samples)
        shards = [
            order.shard(inputs.num_samples, num_shards=layout.num_replicas, shard_index=replica)
            for replica in layout.local_replica_indices
        ]
        # (steps, local replicas * per-replica rows): row s is this process's part of batch s.
        self.indices = np.concatenate([s.indices.reshape(self.steps, -1) for s in shards], axis=1)
        self.mask = np.concatenate([s.mask.reshape(self.steps, -1) for s in shards], axis=1)

    @property
    def padded(self) -> bool:
        """Whether a global batch is padded: the last, short one, or every one when the global batch
        does not divide over the replicas (the steps then leave padded rows out of the loss)."""
        size = self.unpadded_batch_size
        return self.num_samples % size != 0 or size != self.global_batch_size

    def real_rows(self, step: int) -> int:
        """Real rows of global batch ``step``: the unpadded batch size, fewer in the last one."""
        return min(self.unpadded_batch_size, self.num_samples - step * self.unpadded_batch_size)

    def every_replica(self) -> EpochPlan:
        """This epoch as one process driving every replica reads it: whole global batches."""
        if self._layout.num_processes == 1:
            return self
        return EpochPlan(self.inputs, layout=all_replicas_local(self._layout), order=self._order)

    def host_batches(self, start: int = 0) -> Iterator[HostBatch]:
        """This process's rows of every global batch from ``start``."""
        for step in range(start, self.steps):
            x, y, sample_weight = self.inputs.rows(self.indices[step])
            yield HostBatch(x, y, sample_weight, self.mask[step].astype(np.float32), self.real_rows(step))


class HostBatch(NamedTuple):
    """This process's rows of one global batch on the host, with their mask, and the real rows
    of the whole global batch."""

    x: Any
    y: Any
    sample_weight: Any
    mask: np.ndarray
    real_rows: int


class Plan(Protocol):
    """One epoch's global batches: of rows (``EpochPlan``) or of a batch-yielding source
    (``_data.sources.SourcePlan``, whose step count may be unknown)."""

    @property
    def inputs(self) -> Inputs | BatchSource: ...

    @property
    def global_batch_size(self) -> int: ...

    @property
    def steps(self) -> int | None: ...

    @property
    def padded(self) -> bool: ...

    def real_rows(self, step: int) -> int: ...

    def host_batches(self, start: int = 0) -> Iterator[HostBatch]: ...

    def every_replica(self) -> Plan:
        """The same epoch with every replica's rows in each host batch (the whole global batch, on
        every process): for a model's own steps, which place a short batch whole on every device."""
        ...


def all_replicas_local(layout: ReplicaLayout) -> ReplicaLayout:
    """One process driving all of ``layout``'s replicas."""
    return ReplicaLayout(num_processes=1, process_index=0, num_replicas=layout.num_replicas)


def whole_last_batch(model: Any, plan: Plan, *, training: bool = True) -> bool:
    """Whether ``device_batches`` should place a short batch whole (``WholeBatch``): the model
    computes a term over the batch (``dp_core.keras.runs_last_batch_whole``). A global batch that
    does not divide over the replicas makes every batch short of what the mesh holds, so every one
    may go whole."""
    rows = plan.inputs if isinstance(plan.inputs, Inputs) else None
    num_samples = None if rows is None else rows.num_samples
    if isinstance(plan, EpochPlan) and plan.unpadded_batch_size != plan.global_batch_size:
        num_samples = None  # not only the last batch is padded: ask as for an input of unknown length
    return runs_last_batch_whole(
        model, rows, num_samples=num_samples, global_batch_size=plan.global_batch_size, training=training
    )


def padded_batches(plan: Plan, *, whole_last: bool) -> bool:
    """Whether a padded ``Batch`` reaches the step: the plan's short last batch, unless it goes
    whole (``_whole`` places it so for a plan of rows, on every process)."""
    return plan.padded and not (whole_last and isinstance(plan, EpochPlan))


def device_batches(
    plan: Plan, mesh: Mesh, *, start: int = 0, whole_last: bool = False, prefetch: int = PREFETCH
) -> Iterator[Batch]:
    """The plan's batches on the mesh, ``prefetch`` ahead of the consumer (1: none read ahead, as
    Keras reads, where a callback may stop the loop after any batch); with ``whole_last``, a short
    last batch as a ``WholeBatch``.

    jax dispatch is asynchronous, so gathering and transferring batch ``s+1`` here
    overlaps with the step the caller just dispatched on batch ``s``.
    """
    place = BatchPlacer(plan, mesh, whole_last=whole_last)
    ahead: collections.deque[Batch] = collections.deque()
    for step, host in enumerate(plan.host_batches(start), start=start):
        ahead.append(place(host, step))
        if len(ahead) >= prefetch:
            yield ahead.popleft()
    while ahead:
        yield ahead.popleft()


class BatchPlacer:
    """Puts one plan's host batches on the mesh: split over ``"batch"``, padded; with ``whole_last``,
    a short last batch as a ``WholeBatch``. Keeps what every full batch shares (its mask, the real-row
    counts), placed once."""

    def __init__(self, plan: Plan, mesh: Mesh, *, whole_last: bool) -> None:
        self.plan, self.mesh, self.whole_last = plan, mesh, whole_last
        self._real_rows: dict[int, jax.Array] = {}  # few distinct values per epoch: placed once each
        self._no_padding: jax.Array | None = None  # the mask of every full batch, placed once

    def goes_whole(self, host: HostBatch) -> bool:
        """Whether ``host`` may be placed whole (a short batch with ``whole_last``)."""
        return self.whole_last and host.real_rows != self.plan.global_batch_size

    def __call__(self, host: HostBatch, step: int) -> Batch:
        """Global batch ``step``, whose rows on this process are ``host``, on the mesh."""
        plan, mesh = self.plan, self.mesh
        if host.real_rows not in self._real_rows:
            self._real_rows[host.real_rows] = put_replicated(np.float32(host.real_rows), mesh)
        real_rows = self._real_rows[host.real_rows]
        whole = _whole(plan, host, step) if self.goes_whole(host) else None
        if whole is not None:
            return _put_whole(whole, mesh, real_rows)
        full = host.real_rows == plan.global_batch_size
        if full and self._no_padding is None:
            self._no_padding = put_rows([np.ones_like(host.mask)], plan.global_batch_size, mesh)[0]
        return _put(host, plan.global_batch_size, mesh, real_rows, self._no_padding if full else None)


def _put(host: HostBatch, global_batch_size: int, mesh: Mesh, real_rows: jax.Array, mask: jax.Array | None) -> Batch:
    """The host batch on the mesh, split over ``"batch"``, in one transfer; ``mask``: the one already
    placed (a full batch's), else the host's is placed too."""
    parts = (host.x, host.y, host.sample_weight, host.mask if mask is None else None)
    leaves, structure = jax.tree.flatten(parts)
    x, y, sample_weight, own_mask = jax.tree.unflatten(structure, put_rows(leaves, global_batch_size, mesh))
    return Batch(x=x, y=y, sample_weight=sample_weight, mask=own_mask if mask is None else mask, real_rows=real_rows)


def put_rows(leaves: list[np.ndarray], global_batch_size: int, mesh: Mesh, *, stacked: bool = False) -> list[jax.Array]:
    """This process's rows of each global batch array, split over ``"batch"``: one batched transfer
    when this process holds every row (a Python call per array costs a short step much of its time).
    ``stacked``: each array holds several batches on a leading axis, the rows on the second."""
    sharding = NamedSharding(mesh, P(None, BATCH_AXIS)) if stacked else batch_sharded(mesh)
    if jax.process_count() == 1:
        return jax.device_put(leaves, [sharding] * len(leaves))
    lead = 2 if stacked else 1
    return [
        jax.make_array_from_process_local_data(
            sharding, local, (*local.shape[: lead - 1], global_batch_size, *local.shape[lead:])
        )
        for local in leaves
    ]


def _whole(plan: Plan, host: HostBatch, step: int) -> HostBatch | None:
    """Every row of global batch ``step``, on this process: its own when it holds them all, else
    read again as one process holding every replica would (None for a source, whose batch this
    process alone does not hold: it stays padded)."""
    if len(host.mask) == plan.global_batch_size:
        return host
    if not isinstance(plan, EpochPlan):
        return None
    return next(plan.every_replica().host_batches(step))


def _put_whole(host: HostBatch, mesh: Mesh, real_rows: jax.Array) -> WholeBatch:
    real = host.mask > 0
    sharding = replicated(mesh)

    def put(rows: np.ndarray) -> jax.Array:
        rows = rows[real]
        return jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])

    return WholeBatch(
        x=map_structure(put, host.x),
        y=map_structure(put, host.y),
        sample_weight=map_structure(put, host.sample_weight),
        mask=put(host.mask),
        real_rows=real_rows,
    )
