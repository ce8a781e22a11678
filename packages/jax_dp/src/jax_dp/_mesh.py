"""The device mesh: which devices are replicas, and how state and batches lie on them.

Replica ``r`` is the ``r``-th device of the mesh's ``"batch"`` axis. A process feeds
the replicas on its own devices, which must be a contiguous block (jax lists devices
process by process, so the default mesh always is).
"""

from __future__ import annotations

import collections
import os
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dp_core import ReplicaLayout

BATCH_AXIS = "batch"


def make_mesh(num_replicas: int | None) -> Mesh:
    """A 1-D ``"batch"`` mesh over the first ``num_replicas`` devices (all when None).

    With several processes, every process contributes the same number of its first
    local devices, so each process still feeds its own devices.
    """
    devices = _choose_devices(num_replicas)
    return Mesh(mesh_utils.create_device_mesh((len(devices),), devices), (BATCH_AXIS,))


def _choose_devices(num_replicas: int | None) -> list[Any]:
    available = jax.devices()
    if num_replicas is None:
        return available
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive integer or None (every device), got {num_replicas!r}.")
    if num_replicas > len(available):
        raise ValueError(
            f"num_replicas={num_replicas} but jax sees only {len(available)} {jax.default_backend()} device(s): "
            f"{available}. Use num_replicas<={len(available)}, or on a CPU host start Python with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={num_replicas} (currently "
            f"XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}) to split the CPU into that many devices."
        )
    by_process: dict[int, list[Any]] = collections.defaultdict(list)
    for device in available:
        by_process[device.process_index].append(device)
    if num_replicas % len(by_process):
        raise ValueError(
            f"num_replicas={num_replicas} must be a multiple of the number of processes ({len(by_process)}): "
            "every process drives the same number of replicas."
        )
    per_process = num_replicas // len(by_process)
    return [device for process in sorted(by_process) for device in by_process[process][:per_process]]


def check_mesh(mesh: Mesh) -> Mesh:
    """A user-given mesh: 1-D over ``"batch"``, each process's devices contiguous."""
    if not isinstance(mesh, Mesh) or mesh.axis_names != (BATCH_AXIS,):
        names = getattr(mesh, "axis_names", type(mesh).__name__)
        raise ValueError(
            f"mesh must be a jax.sharding.Mesh with the single axis ('{BATCH_AXIS}',), got {names}. "
            f"Build one with Mesh(mesh_utils.create_device_mesh((n,), devices), ('{BATCH_AXIS}',))."
        )
    replica_layout(mesh)
    return mesh


def replica_layout(mesh: Mesh) -> ReplicaLayout:
    """This process's place among the replicas, checked against the mesh's device order."""
    devices = list(mesh.devices.flat)
    processes = sorted({device.process_index for device in devices})
    process_index = jax.process_index()
    layout = ReplicaLayout(
        num_processes=len(processes), process_index=processes.index(process_index), num_replicas=len(devices)
    )
    mine = [r for r, device in enumerate(devices) if device.process_index == process_index]
    if mine != list(layout.local_replica_indices):
        raise ValueError(
            f"The mesh's devices of process {process_index} are at replica positions {mine}, but each process "
            f"must own one contiguous block of {layout.local_replicas} positions. Order the mesh's devices by "
            "process (jax.devices() already is)."
        )
    return layout


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole value (model, optimizer and metric state)."""
    return NamedSharding(mesh, P())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    """Rows split over the replicas in order: replica ``r`` holds the ``r``-th part."""
    return NamedSharding(mesh, P(BATCH_AXIS))


def put_replicated(value: object, mesh: Mesh) -> jax.Array:
    """A host value copied to every device of the mesh, also across processes."""
    array = np.asarray(value)
    return jax.make_array_from_callback(array.shape, replicated(mesh), lambda index: array[index])
