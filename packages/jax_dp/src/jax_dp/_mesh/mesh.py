"""The device mesh: which devices are replicas, and how state and batches lie on them.

The mesh is 1-D ``("batch",)``, or 2-D ``("batch", "model")`` for model parallel
(``_mesh.layout``). Replica ``r`` is the ``r``-th index of the ``"batch"`` axis: one device, or on
a 2-D mesh one row of devices, every one of which sees the same rows of the batch and holds
its part of each variable the layout splits over ``"model"``. A process feeds the replicas
on its own devices, which must be whole rows forming a contiguous block (jax lists devices
process by process, so ``jax.make_mesh`` with a ``"model"`` size dividing each process's
device count always is).
"""

from __future__ import annotations

import collections
import functools
import os
import warnings
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dp_core import ReplicaLayout

BATCH_AXIS = "batch"
MODEL_AXIS = "model"


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
        if len(available) == 1 and available[0].platform == "cpu":
            _say_one_cpu_device()
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


@functools.cache  # once a process: jax's device list is fixed when it starts
def _say_one_cpu_device() -> None:
    """``num_replicas=None`` on a CPU host whose jax was started without forced host devices: one
    replica, which looks like data parallel and is not."""
    flags = os.environ.get("XLA_FLAGS")
    now = "XLA_FLAGS is not set" if flags is None else f"XLA_FLAGS is {flags!r}"
    warnings.warn(
        "jax_dp: jax sees one CPU device, so Trainer() trains on 1 replica. For N replicas on a CPU host, start "
        f"Python with XLA_FLAGS=--xla_force_host_platform_device_count=N (set before jax is imported; {now}). "
        "Pass num_replicas=1 to mean one replica.",
        UserWarning,
        stacklevel=5,  # at the caller's Trainer(): _choose_devices, make_mesh, Trainer.__init__
    )


def check_mesh(mesh: Mesh) -> Mesh:
    """A user-given mesh: ``("batch",)`` or ``("batch", "model")``, each process's devices whole
    rows in one contiguous block."""
    if not isinstance(mesh, Mesh) or mesh.axis_names not in ((BATCH_AXIS,), (BATCH_AXIS, MODEL_AXIS)):
        names = getattr(mesh, "axis_names", type(mesh).__name__)
        raise ValueError(
            f"mesh must be a jax.sharding.Mesh with the axes ('{BATCH_AXIS}',) or ('{BATCH_AXIS}', '{MODEL_AXIS}'), "
            f"got {names}. Build one with jax.make_mesh((n,), ('{BATCH_AXIS}',)) or, for model parallel, "
            f"jax.make_mesh((replicas, model_parts), ('{BATCH_AXIS}', '{MODEL_AXIS}'))."
        )
    replica_layout(mesh)
    return _auto_axes(mesh)


def _auto_axes(mesh: Mesh) -> Mesh:
    """The mesh with jax's automatic (GSPMD) axes: the steps are written for one device and XLA
    partitions them, while ``jax.make_mesh`` makes explicit axes on recent jax, under which an
    operation on a split variable (an embedding lookup) must state its own output sharding."""
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is None or all(kind == axis_type.Auto for kind in getattr(mesh, "axis_types", ())):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(axis_type.Auto,) * len(mesh.axis_names))


def num_replicas_of(mesh: Mesh) -> int:
    """The replicas: the size of the ``"batch"`` axis (a 2-D mesh's rows)."""
    return int(mesh.shape[BATCH_AXIS])


def replica_layout(mesh: Mesh) -> ReplicaLayout:
    """This process's place among the replicas, checked against the mesh's device order."""
    rows = mesh.devices.reshape(num_replicas_of(mesh), -1)  # replica r: row r (one device on a 1-D mesh)
    row_process = []
    for r, row in enumerate(rows):
        owners = sorted({device.process_index for device in row})
        if len(owners) > 1:
            raise ValueError(
                f"Row {r} of the mesh (replica {r}: devices {list(row)}) spans processes {owners}, but each "
                f"'{MODEL_AXIS}' row must lie within one process, which feeds it its rows of the batch. Make the "
                f"'{MODEL_AXIS}' axis size divide every process's device count ({jax.local_device_count()} here) "
                "and order the devices by process, as jax.make_mesh does."
            )
        row_process.append(owners[0])
    processes = sorted(set(row_process))
    process_index = jax.process_index()
    layout = ReplicaLayout(
        num_processes=len(processes), process_index=processes.index(process_index), num_replicas=len(rows)
    )
    mine = [r for r, owner in enumerate(row_process) if owner == process_index]
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
    return put_sharded(value, replicated(mesh))


def put_sharded(value: object, sharding: NamedSharding) -> jax.Array:
    """A host value (the same on every process) placed as ``sharding`` says: each device its part."""
    array = np.asarray(value)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def waits_for_each_step(mesh: Mesh) -> bool:
    """Whether the host waits for each train step before it dispatches the next: on a mesh of
    several CPU devices in one process. There XLA's runtime can deadlock when steps queue up: with
    matmuls a thousand columns wide, a step's all-reduce waits for a device busy with a later step,
    until XLA aborts the process after 40 s. Waiting costs little on CPU, where the devices share
    the host's cores anyway, and the next batch is still prepared while a step runs. GPUs and TPUs
    queue steps. Several processes keep queuing: a wait there would meet a lost process as a gloo
    error before jax's own report of which process failed."""
    devices = list(mesh.devices.flat)
    one_process = jax.process_count() == 1
    return one_process and len(devices) > 1 and on_cpu(mesh)


def on_cpu(mesh: Mesh) -> bool:
    """Whether every device of ``mesh`` is a CPU."""
    return all(device.platform == "cpu" for device in mesh.devices.flat)
