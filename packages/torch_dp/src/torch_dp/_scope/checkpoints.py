"""Checkpoints of a scoped model: each replica writes its own parts and rank 0 the rest
(``save_by_parts``, dp-core's format version 2, committed atomically by rank 0), and a resumed fit
puts each variable's value back part by part (``put_by_parts``), so no replica gathers the whole
state to write it, and no replica but rank 0 holds more than its parts to read it. On a mesh the
processes of its first row write the parts of the split variables (every row holds the same)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import torch
import torch.distributed as dist

from dp_core import Part, Parts, PartsWritten, stage_checkpoint, write_process_parts
from dp_core.keras import CheckpointWriter, StagedParts, internals
from torch_dp._comm.collectives import _entering, broadcast_from_primary, broadcast_object
from torch_dp._comm.replica import Replica
from torch_dp._scope.layout import holdings, mesh_held, stored_layout
from torch_dp._scope.materialize import ByPieces, Placing
from torch_dp._scope.mesh_parts import ByMeshParts
from torch_dp._step.owners import Piece


def held_variables(model: keras.Model) -> dict[int, list[Piece]]:
    """The model's variables held by pieces (by identity), as its layout says."""
    return holdings(model, stored_layout(model))


OwnParts = Callable[[keras.Variable, int], Parts | None]


def _own_parts_of(model: keras.Model) -> OwnParts:
    """What process ``rank`` writes of a variable held by parts (None: a variable every process holds whole)."""
    layout = stored_layout(model)
    if layout.mesh is None:
        held = holdings(model, layout)
        return lambda variable, rank: _own_parts(variable, held[id(variable)], rank) if id(variable) in held else None
    axes, columns = mesh_held(model, layout.mesh), layout.mesh.columns

    def own(variable: keras.Variable, rank: int) -> Parts | None:
        axis = axes.get(id(variable))
        if axis is None:
            return None
        stored = internals.stored_value(variable).detach().cpu().numpy()
        start = [0] * len(variable.shape)
        start[axis] = rank * stored.shape[axis]
        parts = [Part(tuple(start), stored)] if rank < columns else []  # row 0's: rank is its column
        return Parts(tuple(int(s) for s in variable.shape), stored.dtype, parts)

    return own


def _placing_of(model: keras.Model, replica: Replica) -> tuple[Placing, set[int]]:
    """Where a scoped model's restored values go, and the variables held by parts (by identity)."""
    layout = stored_layout(model)
    if layout.mesh is None:
        held = holdings(model, layout)
        return ByPieces(held, replica), set(held)
    axes = mesh_held(model, layout.mesh)
    return ByMeshParts(axes, layout.mesh, replica), set(axes)


def _keyed(model: keras.Model) -> list[tuple[str, keras.Variable]]:
    """The arrays of a checkpoint by their names, as ``dp_core.keras.model_checkpoint`` orders them."""
    optimizer = list(model.optimizer.variables) if getattr(model, "optimizer", None) is not None else []
    return [(f"weights/{i}", v) for i, v in enumerate(model.weights)] + [
        (f"optimizer_variables/{i}", v) for i, v in enumerate(optimizer)
    ]


def _own_parts(variable: keras.Variable, pieces: Sequence[Piece], rank: int) -> Parts:
    stored = internals.stored_value(variable).detach().cpu().numpy()
    ndim = len(variable.shape)
    parts = [
        Part((0,) * ndim if p.rows is None else (p.rows[0], *(0,) * (ndim - 1)), stored)
        for p in pieces
        if p.owner == rank
    ]
    return Parts(tuple(int(s) for s in variable.shape), stored.dtype, parts)


def save_by_parts(
    writer: CheckpointWriter | None,
    model: keras.Model,
    replica: Replica,
    *,
    epoch: int,
    step: int,
    metric_variables: list[Any],
    random_streams: dict[str, str] | None = None,
) -> None:
    """A checkpoint at ``step`` of ``epoch`` (``writer``: rank 0's, None elsewhere): rank 0 stages it, every
    other replica writes its parts there, rank 0 writes its own, the variables every replica holds whole and
    the manifest (with torch's ``random_streams``: ``_step.streams``), then commits it."""
    own = _own_parts_of(model)
    staged_in = str(stage_checkpoint(writer.directory)) if replica.is_primary and writer is not None else None
    folder: str = broadcast_object(staged_in, replica)
    written: PartsWritten | None = None
    if not replica.is_primary:
        arrays = {key: parts for key, v in _keyed(model) if (parts := own(v, replica.rank)) is not None}
        arrays = {key: parts for key, parts in arrays.items() if parts.parts}
        written = write_process_parts(folder, replica.rank, arrays) if arrays else None
    records: list[PartsWritten | None] = [None] * replica.num_replicas
    _entering()
    dist.all_gather_object(records, written, group=replica.group)
    if not replica.is_primary:
        return
    assert writer is not None

    def read(variable: keras.Variable) -> Any:
        if (parts := own(variable, 0)) is not None:
            return parts
        return np.asarray(keras.ops.convert_to_numpy(internals.stored_value(variable)))

    others = [record for record in records if record is not None]
    staged = StagedParts(folder, others)
    writer.write(
        model,
        epoch=epoch,
        step=step,
        metric_variables=metric_variables,
        read=read,
        staged=staged,
        random_streams=random_streams,
    )


def put_by_parts(model: keras.Model, values: dict[int, Any], replica: Replica) -> None:
    """Rank 0's restored ``values`` (by variable identity; empty on the other replicas) in place: each
    variable held by pieces sent part by part to its holders, the others (random layers' seed states
    too, when the checkpoint holds them) broadcast whole."""
    placing, held = _placing_of(model, replica)
    variables = [v for _, v in _keyed(model)]
    for variable in variables:
        if id(variable) in held:
            whole = None
            if replica.is_primary:
                whole = torch.as_tensor(keras.ops.convert_to_tensor(values[id(variable)], variable.dtype))
                whole = whole.to(replica.device)
            placing.place(variable, whole)
    seed_states = [  # every replica draws from rank 0's streams (_loop.run.same_random_streams)
        g.state
        for layer in internals.flatten_layers(model, include_self=True)
        for g in internals.seed_generators(layer)
    ]
    whole_ones = [v for v in variables if id(v) not in held] + seed_states
    if replica.is_primary:
        for variable in whole_ones:
            if id(variable) in values:
                variable.assign(values[id(variable)])
    if whole_ones:
        values_now = broadcast_from_primary([v.value for v in whole_ones], replica)
        for variable, value in zip(whole_ones, values_now, strict=True):
            variable.assign(value)
