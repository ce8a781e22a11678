"""Global batches on the mesh, prepared on the host while the devices compute.

Each process gathers only the rows of its own replicas (dp_core.split_indices per
local replica, concatenated in replica order) and hands them to
``jax.make_array_from_process_local_data``; the result is one batch-sharded global
array per input leaf, plus the padding mask.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dp_core import ReplicaLayout, num_steps, split_indices
from dp_core.keras import Inputs, map_structure
from jax_dp._mesh import batch_sharded, put_replicated

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


def row_weights(batch: Batch, *, scale_to_real_rows: bool) -> Any:
    """``sample_weight * mask``, times ``B / real_rows`` for the loss (see ``_steps``)."""
    weights = batch.mask
    if scale_to_real_rows:
        weights = weights * (batch.mask.shape[0] / batch.real_rows)
    if batch.sample_weight is None:
        return weights

    def weigh(sample_weight: Any) -> Any:
        return sample_weight * jnp.reshape(weights, (-1,) + (1,) * (sample_weight.ndim - 1))

    return map_structure(weigh, batch.sample_weight)


class EpochPlan:
    """This process's rows for every step of one epoch, in replica order."""

    def __init__(
        self,
        inputs: Inputs,
        *,
        layout: ReplicaLayout,
        global_batch_size: int,
        epoch: int = 0,
        seed: int = 0,
        shuffle: bool = False,
    ) -> None:
        self.inputs = inputs
        self.global_batch_size = global_batch_size
        self.steps = num_steps(inputs.num_samples, global_batch_size)
        shards = [
            split_indices(
                inputs.num_samples,
                num_shards=layout.num_replicas,
                shard_index=replica,
                global_batch_size=global_batch_size,
                seed=seed,
                epoch=epoch,
                shuffle=shuffle,
            )
            for replica in layout.local_replica_indices
        ]
        # (steps, local replicas * per-replica rows): row s is this process's part of batch s.
        self.indices = np.concatenate([s.indices.reshape(self.steps, -1) for s in shards], axis=1)
        self.mask = np.concatenate([s.mask.reshape(self.steps, -1) for s in shards], axis=1)

    def real_rows(self, step: int) -> int:
        """Real rows of global batch ``step``: all but in the padded last one."""
        return min(self.global_batch_size, self.inputs.num_samples - step * self.global_batch_size)


def device_batches(plan: EpochPlan, mesh: Mesh, *, start: int = 0) -> Iterator[Batch]:
    """The plan's batches on the mesh, ``PREFETCH`` ahead of the consumer.

    jax dispatch is asynchronous, so gathering and transferring batch ``s+1`` here
    overlaps with the step the caller just dispatched on batch ``s``.
    """
    ahead: collections.deque[Batch] = collections.deque()
    real_rows: dict[int, jax.Array] = {}  # two distinct values per epoch: placed once each
    step = start
    while step < plan.steps or ahead:
        while step < plan.steps and len(ahead) < PREFETCH:
            count = plan.real_rows(step)
            if count not in real_rows:
                real_rows[count] = put_replicated(np.float32(count), mesh)
            ahead.append(_put(plan, step, mesh, real_rows[count]))
            step += 1
        yield ahead.popleft()


def _put(plan: EpochPlan, step: int, mesh: Mesh, real_rows: jax.Array) -> Batch:
    sharding = batch_sharded(mesh)
    x, y, sample_weight = plan.inputs.rows(plan.indices[step])
    local_mask = plan.mask[step].astype(np.float32)

    def put(local: np.ndarray) -> jax.Array:
        global_shape = (plan.global_batch_size, *local.shape[1:])
        return jax.make_array_from_process_local_data(sharding, local, global_shape)

    return Batch(
        x=map_structure(put, x),
        y=map_structure(put, y),
        sample_weight=map_structure(put, sample_weight),
        mask=put(local_mask),
        real_rows=real_rows,
    )
