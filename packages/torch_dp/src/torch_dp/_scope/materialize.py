"""A scoped model's deferred variables made (``materialize``), at the first call that needs them:
rank 0 runs each one's initializer whole, one variable at a time in the order Keras created them,
keeps its own part and sends every other replica its part (its rows, or the whole variable to its
owner, or the whole to all). So no replica but rank 0 ever holds what it does not own, rank 0 holds
one whole variable beyond its own parts at a time, and every value is bitwise an unsharded build's.
A variable loaded from an h5 file in the scope (``_scope.loading``) is read by each of its holders,
its own part only, from the file: nothing is sent, and no replica reads what it does not hold (a
``.keras`` archive's weights from the caller's temporary copy, which lives until every replica read).
Where each value goes is a ``Placing``'s: ``ByPieces`` for ``shard=``'s pieces, ``_scope.mesh_parts``'s on a mesh."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import keras
import torch
import torch.distributed as dist

from torch_dp._comm.collectives import _entering, all_reduce_sum, broadcast_object
from torch_dp._comm.replica import Replica
from torch_dp._internals import set_stored_value
from torch_dp._scope.deferred import in_creation_order, initial_value, is_deferred, made, stored_source
from torch_dp._scope.loading import StoredValue
from torch_dp._step.owners import Piece, rows_shape


class Placing(Protocol):
    """Where a scoped model's first values go."""

    def place(self, variable: keras.Variable, whole: torch.Tensor | None) -> None:
        """Rank 0's ``whole`` value (None on the other processes) given to its holders, each its part."""
        ...

    def read(self, variable: keras.Variable, file: StoredValue) -> None:
        """This process's part of ``variable``, read from ``file``."""
        ...


class ByPieces:
    """``shard=``'s placing: the variables of ``held`` by their pieces, the others whole on every replica."""

    def __init__(self, held: dict[int, list[Piece]], replica: Replica) -> None:
        self.held, self.replica = held, replica

    def place(self, variable: keras.Variable, whole: torch.Tensor | None) -> None:
        pieces = self.held.get(id(variable))
        if pieces is None:
            everywhere(variable, whole, self.replica)
        else:
            send_parts(variable, whole, pieces, self.replica)

    def read(self, variable: keras.Variable, file: StoredValue) -> None:
        _read_own_part(variable, file, self.held.get(id(variable)), self.replica)


def materialize(variables: Sequence[keras.Variable], placing: Placing, replica: Replica) -> None:
    """Every deferred one of ``variables`` (the same list on every replica) given its value or part."""
    primary_order: list[int] = broadcast_object(in_creation_order(variables), replica)
    # where rank 0's variables lie in a file, if they were loaded from one (the others' know nothing of it)
    sources = [stored_source(variables[i]) for i in primary_order] if replica.is_primary else []
    files: list[StoredValue | None] = broadcast_object(sources, replica)
    for index, file in zip(primary_order, files, strict=True):
        variable = variables[index]
        if file is not None:
            placing.read(variable, file)
            made(variable)
            continue
        whole = initial_value(variable).to(replica.device) if replica.is_primary else None
        placing.place(variable, whole)
        made(variable)
    if replica.distributed and any(file is not None and file.temporary for file in files):
        all_reduce_sum([torch.zeros(1, device=replica.device)], replica)  # all read: rank 0 may drop the file
    for index in _deferred_elsewhere(variables, primary_order, replica):
        # made with a value in the caller (compiled outside the scope: the optimizer's step counter and
        # learning rate), and deferred in the workers, which rebuild and compile in a scope: rank 0's value
        whole = torch.as_tensor(variables[index].value).detach().clone() if replica.is_primary else None
        placing.place(variables[index], whole)
        made(variables[index])


def _deferred_elsewhere(variables: Sequence[keras.Variable], primary_order: list[int], replica: Replica) -> list[int]:
    """The indices, ascending, of the variables some other replica awaits a value for and rank 0 does not."""
    if not replica.distributed:
        return []
    primary_count: int = broadcast_object(len(variables), replica)
    flag = torch.tensor([float(len(variables) != primary_count)], device=replica.device)
    (differing,) = all_reduce_sum([flag], replica)
    if differing.item():
        raise RuntimeError(
            f"torch_dp: the replicas rebuilt a model built in a trainer's scope with other variables ({len(variables)} "
            f"here, {primary_count} on rank 0). A model built in the scope must build the same variables on every "
            "replica: give its layers a get_config() that rebuilds them."
        )
    awaited = torch.tensor([float(is_deferred(v)) for v in variables], dtype=torch.float64, device=replica.device)
    (awaited,) = all_reduce_sum([awaited], replica)
    primary = set(primary_order)
    return [i for i, count in enumerate(awaited.tolist()) if count > 0 and i not in primary]


def _read_own_part(
    variable: keras.Variable, file: StoredValue, pieces: Sequence[Piece] | None, replica: Replica
) -> None:
    """This replica's part of ``variable`` read from ``file``: all of it where every replica holds it whole,
    its rows where it holds some, nothing where another owns it."""
    if pieces is None:
        set_stored_value(variable, tensor_of(file.read(None), variable, replica))
        return
    for piece in pieces:
        if piece.owner == replica.rank:
            set_stored_value(variable, tensor_of(file.read(piece.rows), variable, replica))


def tensor_of(values: Any, variable: keras.Variable, replica: Replica) -> torch.Tensor:
    """As ``initial_value`` converts a value: Keras's own conversion to the variable's dtype."""
    return torch.as_tensor(keras.ops.convert_to_tensor(values, variable.dtype)).to(replica.device)


def everywhere(variable: keras.Variable, whole: torch.Tensor | None, replica: Replica) -> None:
    if whole is None:
        whole = torch.empty(tuple(variable.shape), dtype=dtype_of(variable), device=replica.device)
    if replica.distributed:
        _entering()
        dist.broadcast(whole, src=0, group=replica.group)
    set_stored_value(variable, whole)


def send_parts(variable: keras.Variable, whole: torch.Tensor | None, pieces: Sequence[Piece], replica: Replica) -> None:
    """Each holder of ``variable`` given its part of rank 0's ``whole`` (None on the other replicas)."""
    for piece in pieces:
        part = None
        if whole is not None:
            part = whole if piece.rows is None else whole[piece.rows[0] : piece.rows[1]]
        if piece.owner == 0:
            if part is not None:
                set_stored_value(variable, part.clone())
        elif replica.is_primary:
            assert part is not None
            _entering()
            dist.send(part.contiguous(), dst=piece.owner, group=replica.group)
        elif replica.rank == piece.owner:
            mine = torch.empty(rows_shape(variable.shape, piece.rows), dtype=dtype_of(variable), device=replica.device)
            _entering()
            dist.recv(mine, src=0, group=replica.group)
            set_stored_value(variable, mine)


def dtype_of(variable: keras.Variable) -> torch.dtype:
    return getattr(torch, keras.backend.standardize_dtype(variable.dtype))
