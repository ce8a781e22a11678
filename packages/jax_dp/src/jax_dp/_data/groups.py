"""An epoch's batches in Keras's ``steps_per_execution`` groups (``dp_core.keras.Executions``).

A group is the steps between two batch hooks. For Keras's own train step a whole group of
same-shaped batches goes to the mesh stacked (``Group.stacked``): one array per leaf with the
group's batches on a new leading axis, each batch split over ``"batch"`` on the second, in one
transfer, which one compiled ``jax.lax.scan`` of the step runs (as Keras's jax trainer runs a
group). Any other group (the epoch's shorter last group, one holding a batch placed whole, a
model's own step, evaluate and predict) is its batches one by one (``Group.batches``).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from typing import Any, Generic, NamedTuple, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh

from dp_core.keras import Executions
from jax_dp._data.batches import PREFETCH, Batch, BatchPlacer, HostBatch, Plan, put_rows
from jax_dp._mesh.mesh import put_replicated

Item = TypeVar("Item")


class Group(NamedTuple, Generic[Item]):
    """Steps ``first .. first + size - 1`` of an epoch, run between two batch hooks: their batches
    one by one (``batches``), or, when ``stacked`` is not None, all of them in it (``batches`` empty)."""

    first: int
    size: int
    batches: tuple[Item, ...]
    stacked: Batch | None = None

    @property
    def last(self) -> int:
        """The group's last step."""
        return self.first + self.size - 1


def groups_of(
    items: Iterable[Item], executions: Executions, steps: int | None, *, start: int = 0
) -> Iterator[Group[Item]]:
    """``items`` (one per step, from step ``start``) in groups; a group is yielded as soon as its
    last item is read (none read past it: a callback may stop the loop after it), the data's end
    closing the last one."""
    first, batch = start, []
    for step, item in enumerate(items, start=start):
        batch.append(item)
        if executions.last(step, steps):
            yield Group(first, len(batch), tuple(batch))
            first, batch = step + 1, []
    if batch:
        yield Group(first, len(batch), tuple(batch))


def device_groups(
    plan: Plan,
    mesh: Mesh,
    executions: Executions,
    *,
    start: int = 0,
    whole_last: bool = False,
    stack: bool = False,
    prefetch: int = PREFETCH,
) -> Iterator[Group[Batch]]:
    """The plan's batches on the mesh in groups, ``prefetch`` groups ahead of the consumer (1: none
    read ahead); with ``stack``, a group of ``executions.size`` (> 1) same-shaped padded batches is
    stacked, the others are placed one by one (see the module's docstring)."""
    place = BatchPlacer(plan, mesh, whole_last=whole_last)
    ahead: collections.deque[Group[Batch]] = collections.deque()
    for group in groups_of(plan.host_batches(start), executions, plan.steps, start=start):
        if stack and group.size == executions.size > 1 and _stackable(group.batches, place):
            ahead.append(Group(group.first, group.size, (), _put_stacked(group.batches, plan, mesh)))
        else:
            batches = tuple(place(host, group.first + at) for at, host in enumerate(group.batches))
            ahead.append(Group(group.first, group.size, batches))
        if len(ahead) >= prefetch:
            yield ahead.popleft()
    while ahead:
        yield ahead.popleft()


def _stackable(hosts: tuple[HostBatch, ...], place: BatchPlacer) -> bool:
    """Whether the host batches stack: none placed whole, every leaf of one shape and dtype."""
    if any(place.goes_whole(host) for host in hosts):
        return False
    signatures = {_signature(host) for host in hosts}
    return len(signatures) == 1


def _signature(host: HostBatch) -> Any:
    leaves, structure = jax.tree.flatten((host.x, host.y, host.sample_weight, host.mask))
    return structure, tuple((np.shape(leaf), np.asarray(leaf).dtype.str) for leaf in leaves)


def _put_stacked(hosts: tuple[HostBatch, ...], plan: Plan, mesh: Mesh) -> Batch:
    """The host batches as one ``Batch`` on the mesh, each leaf ``(len(hosts), global batch, ...)``
    split over ``"batch"`` on its second axis, in one transfer; ``real_rows`` ``(len(hosts),)``."""
    parts = [(host.x, host.y, host.sample_weight, host.mask) for host in hosts]
    stacked = jax.tree.map(lambda *leaves: np.stack(leaves), *parts)
    leaves, structure = jax.tree.flatten(stacked)
    placed = put_rows(leaves, plan.global_batch_size, mesh, stacked=True)
    x, y, sample_weight, mask = jax.tree.unflatten(structure, placed)
    real_rows = put_replicated(np.asarray([host.real_rows for host in hosts], np.float32), mesh)
    return Batch(x=x, y=y, sample_weight=sample_weight, mask=mask, real_rows=real_rows)
