"""A model built in a mesh trainer's scope (``Trainer(mesh=...).scope()``): where each process holds
its parts (``ByMeshParts``) and how the caller reads or writes one held variable between calls
(``serve_parts``).

Along each mesh row of C processes a variable the layout splits lies in C equal parts along its split
axis, process (row, column) holding part ``column``, as every process of its mesh column does; so do
its optimizer slots (``_scope.layout.mesh_held``). Rank 0 makes each deferred variable's value whole,
one at a time (``_scope.materialize``), keeps its own part and sends every other process its part: no
other process ever holds a split variable whole, and rank 0 only that one variable while it is made.
A variable loaded from an h5 file in the scope is read by each process, its part only. Every other
variable is whole on every process (broadcast)."""

from __future__ import annotations

import keras
import torch
import torch.distributed as dist

from dp_core.keras import internals
from torch_dp._comm.collectives import _entering
from torch_dp._comm.replica import Replica
from torch_dp._internals import set_stored_value
from torch_dp._scope.layout import MeshParts
from torch_dp._scope.loading import StoredValue
from torch_dp._scope.materialize import dtype_of, everywhere, tensor_of


class ByMeshParts:
    """The placing (``_scope.materialize.Placing``) of a mesh scope's model: the variables of ``axes``
    (identity: split axis) by mesh parts, every other one whole; ``replica``: this process among all the mesh's."""

    def __init__(self, axes: dict[int, int], parts: MeshParts, replica: Replica) -> None:
        self.axes, self.parts, self.replica = axes, parts, replica

    def place(self, variable: keras.Variable, whole: torch.Tensor | None) -> None:
        axis = self.axes.get(id(variable))
        if axis is None:
            everywhere(variable, whole, self.replica)
            return
        replica, columns = self.replica, self.parts.columns
        if replica.is_primary:
            assert whole is not None
            for rank in range(1, replica.num_replicas):
                _entering()
                dist.send(part_of(whole, axis, rank % columns, columns).contiguous(), dst=rank, group=replica.group)
            set_stored_value(variable, part_of(whole, axis, 0, columns).clone())
            return
        mine = torch.empty(part_shape(variable, axis, columns), dtype=dtype_of(variable), device=replica.device)
        _entering()
        dist.recv(mine, src=0, group=replica.group)
        set_stored_value(variable, mine)

    def read(self, variable: keras.Variable, file: StoredValue) -> None:
        axis = self.axes.get(id(variable))
        if axis is None:
            set_stored_value(variable, tensor_of(file.read(None), variable, self.replica))
            return
        width = int(variable.shape[axis]) // self.parts.columns
        start = self.parts.column * width
        set_stored_value(variable, tensor_of(file.read_part(axis, start, start + width), variable, self.replica))


def part_of(whole: torch.Tensor, axis: int, column: int, columns: int) -> torch.Tensor:
    """Column ``column``'s part of ``whole`` (a view)."""
    width = whole.shape[axis] // columns
    return whole.narrow(axis, column * width, width)


def part_shape(variable: keras.Variable, axis: int, columns: int) -> tuple[int, ...]:
    shape = [int(size) for size in variable.shape]
    shape[axis] //= columns
    return tuple(shape)


def serve_parts(
    variable: keras.Variable, axis: int, parts: MeshParts, replica: Replica, value: torch.Tensor | None, *, write: bool
) -> torch.Tensor | None:
    """For the caller between calls: a held variable gathered whole onto rank 0 from mesh row 0's processes
    (returned there), or (``write``) rank 0's ``value`` given to every process, each its part."""
    if write:
        ByMeshParts({id(variable): axis}, parts, replica).place(variable, value)
        return None
    mine = internals.stored_value(variable).detach()
    if replica.rank >= parts.columns:  # another row's: row 0 holds every part
        return None
    if not replica.is_primary:
        _entering()
        dist.send(mine.contiguous(), dst=0, group=replica.group)
        return None
    whole = torch.empty(tuple(int(s) for s in variable.shape), dtype=mine.dtype, device=replica.device)
    part_of(whole, axis, 0, parts.columns).copy_(mine)
    for rank in range(1, parts.columns):
        received = torch.empty_like(mine)
        _entering()
        dist.recv(received, src=rank, group=replica.group)
        part_of(whole, axis, rank, parts.columns).copy_(received)
    return whole
