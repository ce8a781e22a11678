"""The process groups of a mesh: each process's row (the processes that split its layers) and its
column (the replicas it averages gradients with), as ``Replica`` values.

Process-global state: the groups formed last, kept with the group they were formed from (forming
them is a collective of every process, the same on each). Every process asks for them at the same
point of the same call, so they form or are found in step; a new pool's group forms new ones.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist

from torch_dp._comm.replica import Replica
from torch_dp._internals import new_subgroups
from torch_dp._mesh.plan import Mesh


class MeshPlaces(NamedTuple):
    """This process on the mesh: ``column`` is its replica (rank = its row's index, among the mesh's
    rows), ``row`` its place in its row (rank = its column's index, among the row's processes)."""

    column: Replica
    row: Replica


class _Formed(NamedTuple):
    world: dist.ProcessGroup | None
    mesh: Mesh
    places: MeshPlaces


_formed: _Formed | None = None


def mesh_places(replica: Replica, mesh: Mesh) -> MeshPlaces:
    """``replica``'s (one of the mesh's ``mesh.num_processes`` processes) row and column groups."""
    global _formed
    if replica.num_replicas != mesh.num_processes:
        raise ValueError(
            f"the mesh {mesh.shape()} needs {mesh.num_processes} processes (rows x columns), but "
            f"{replica.num_replicas} run this call. Start as many processes as the mesh has places."
        )
    if _formed is not None and _formed.world is replica.group and _formed.mesh == mesh:
        return _formed.places
    rows, columns = mesh.row_ranks(), mesh.column_ranks()
    groups = new_subgroups(replica.group, [*rows, *columns])
    row_index, column_index = divmod(replica.rank, mesh.columns)
    row = Replica(column_index, mesh.columns, replica.device, groups[row_index])
    column = Replica(row_index, mesh.rows, replica.device, groups[len(rows) + column_index], partners=row)
    places = MeshPlaces(column=column, row=row)
    _formed = _Formed(replica.group, mesh, places)
    return places
