"""A call on a scoped model, on each replica: its variables built deferred and made by the model's
layout (``prepared``; on a mesh ``prepared_on_mesh``, which ``ON_MESH`` hands ``_mesh.run``), its weights
gathered layer by layer where the layout holds them by pieces (``weights_by_layer``), and one variable
read or written for the caller between calls (``serve``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import keras
import torch
import torch.distributed as dist

from dp_core import ShardMode
from dp_core.keras import internals
from torch_dp._comm.collectives import _entering, broadcast_from_primary
from torch_dp._comm.replica import Replica
from torch_dp._scope.checkpoints import put_by_parts, save_by_parts
from torch_dp._scope.deferred import deferring, scoped_mode
from torch_dp._scope.held import calling
from torch_dp._scope.layout import Layout, MeshParts, holdings, layout_of, mesh_held, mesh_layout_of, stored_layout
from torch_dp._scope.materialize import ByPieces, materialize, send_parts
from torch_dp._scope.mesh_parts import ByMeshParts, serve_parts
from torch_dp._step.gathered import JustInTime
from torch_dp._step.owners import rows_shape


@dataclass(frozen=True)
class VariableJob:
    """The caller reads (``value`` None) or writes one variable of a scoped model, by its index
    among ``state_variables``; every replica takes part."""

    index: int
    write: bool


def state_variables(model: keras.Model, *, optimizer: bool = True) -> list[keras.Variable]:
    """Every variable a call of ``model`` holds, in one order on every replica: the model's, its compiled
    metrics' and (with ``optimizer``, once built) its optimizer's, last: a worker's optimizer is built
    when its model is compiled, the caller's at its first fit, and the indices before agree on all."""
    found: dict[int, keras.Variable] = {}
    built = getattr(model, "optimizer", None)
    optimizer_variables = list(built.variables) if optimizer and built is not None and built.built else []
    metric_variables = [v for metric in model.metrics for v in metric.variables]
    for variable in [*model.variables, *metric_variables, *optimizer_variables]:
        found.setdefault(id(variable), variable)
    return list(found.values())


def prepared(
    model: keras.Model, mode: ShardMode | None, replica: Replica, build: Callable[[], None], *, trains: bool
) -> Layout:
    """``build`` run with new variables deferred (and the optimizer built when the call ``trains``),
    then every deferred variable made by the model's layout; returns the layout."""
    with deferring(mode):
        build()
        optimizer = getattr(model, "optimizer", None)
        if trains and optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_weights)
    layout = layout_of(model, mode, replica.num_replicas)
    if layout.mesh is None:  # a mesh scope's are made for the whole mesh first (``_scope.mesh_parts``)
        materialize(state_variables(model, optimizer=trains), ByPieces(holdings(model, layout), replica), replica)
    return layout


def prepared_on_mesh(
    model: keras.Model,
    replica: Replica,
    build: Callable[[], None],
    axes: tuple[tuple[int, int], ...],
    *,
    column: int,
    columns: int,
    rows: int,
    trains: bool,
    sync: bool,
) -> None:
    """``prepared`` for a model built in a mesh trainer's scope, on ``replica`` (this process among all the
    mesh's ``rows`` x ``columns``, at ``column``): the variables of ``axes`` (identity, split axis) and their
    slots made as parts (``_scope.mesh_parts``), the others whole, and (``sync``) rank 0's values of the
    whole ones on every process."""
    parts = MeshParts(column, columns, axes)
    with deferring(None):
        build()
        optimizer = getattr(model, "optimizer", None)
        if trains and optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_weights)
    layout = mesh_layout_of(model, parts, rows)
    placing = ByMeshParts(mesh_held(model, parts), parts, replica)
    materialize(state_variables(model, optimizer=trains), placing, replica)
    if sync:
        sync_whole_ones(model, layout, replica, trains=trains)


class OnMesh:
    """What a call on a mesh (``_mesh.run``, which cannot import this wing) asks of a scoped model."""

    @staticmethod
    def scoped(model: keras.Model) -> bool:
        return scoped_mode(model)[0]

    calling = staticmethod(calling)
    prepare = staticmethod(prepared_on_mesh)
    save = staticmethod(save_by_parts)
    put = staticmethod(put_by_parts)


ON_MESH = OnMesh()


def sync_whole_ones(model: keras.Model, layout: Layout, replica: Replica, *, trains: bool) -> None:
    """Rank 0's values of the variables every replica holds whole (what the caller may have assigned
    between calls: a learning rate, statistics); the parts stay where they are."""
    held = holdings(model, layout)
    whole = [v for v in state_variables(model, optimizer=trains) if id(v) not in held]
    if replica.distributed and whole:
        values = broadcast_from_primary([v.value for v in whole], replica)
        for variable, value in zip(whole, values, strict=True):
            variable.assign(value)


@contextlib.contextmanager
def weights_by_layer(model: keras.Model, layout: Layout, replica: Replica) -> Iterator[None]:
    """Within the block each layer gathers the weights the layout holds by pieces around its call
    (``_step.gathered``), as a ``"full"`` fit does: for evaluate, predict and a fit's probes."""
    if layout.mode != "full" or not replica.distributed:
        yield
        return
    weights = JustInTime(model, list(model.trainable_weights), list(layout.pieces), replica)
    weights.install()
    try:
        yield
    finally:
        weights.uninstall()


def serve(model: keras.Model, job: VariableJob, replica: Replica, value: Any = None) -> torch.Tensor | None:
    """The variable ``job`` names, gathered whole onto rank 0 (returned there), or ``value`` (rank 0's)
    given to its holders, each its part."""
    layout = stored_layout(model)
    variable = state_variables(model)[job.index]
    if layout.mesh is not None:
        axis = mesh_held(model, layout.mesh)[id(variable)]
        whole = None
        if job.write and replica.is_primary:
            whole = torch.as_tensor(keras.ops.convert_to_tensor(value, variable.dtype)).to(replica.device)
            whole = whole.reshape(tuple(variable.shape))
        return serve_parts(variable, axis, layout.mesh, replica, whole, write=job.write)
    pieces = holdings(model, layout)[id(variable)]
    if job.write:
        whole = None
        if replica.is_primary:
            whole = torch.as_tensor(keras.ops.convert_to_tensor(value, variable.dtype)).to(replica.device)
            whole = whole.reshape(tuple(variable.shape))
        send_parts(variable, whole, pieces, replica)
        return None
    mine = internals.stored_value(variable).detach()
    whole = torch.empty(tuple(variable.shape), dtype=mine.dtype, device=replica.device) if replica.is_primary else None
    for piece in pieces:
        if piece.owner == replica.rank and whole is None:
            _entering()
            dist.send(mine.contiguous(), dst=0, group=replica.group)
        elif whole is not None:
            part = whole if piece.rows is None else whole[piece.rows[0] : piece.rows[1]]
            if piece.owner == 0:
                part.copy_(mine)
            else:
                received = torch.empty(rows_shape(variable.shape, piece.rows), dtype=mine.dtype, device=replica.device)
                _entering()
                dist.recv(received, src=piece.owner, group=replica.group)
                part.copy_(received)
    return whole
