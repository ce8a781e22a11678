"""A call on a mesh: its job marked with the call's ``MeshPlan`` (``on_mesh``), and what every process
of the mesh runs for it (``run_on_mesh``).

A job on a mesh is one of ``dp_core.keras``'s jobs with the plan added (a subclass, so every
``isinstance`` and ``dataclasses.replace`` that reads or copies a job keeps it, the way to the
workers included). ``_loop.run.run_job`` hands it here, and gets the job without its plan back to run
as plain data parallel over the process's mesh column, its split layers in place: each mesh row is one
replica, and its processes read the same rows, draw the same noise and compute the same logs. A model
built in a mesh trainer's scope is made by parts at its first call and keeps them (``Scoping``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import keras

from dp_core.keras import EvaluateJob, FitJob, Job, PredictJob, adopt_batch_terms, batch_terms
from torch_dp._comm.collectives import broadcast_object
from torch_dp._comm.replica import Replica
from torch_dp._mesh.epochs import fit_by_epochs
from torch_dp._mesh.groups import mesh_places
from torch_dp._mesh.layers import split_layers
from torch_dp._mesh.plan import MeshPlan, bias_of, splittable_layers, weight_of
from torch_dp._mesh.scoping import Scoping
from torch_dp._step.broadcast import check_same_variables, same_state_as_primary


@dataclasses.dataclass(frozen=True)
class FitOnMesh(FitJob[Any]):
    plan: MeshPlan | None = None


@dataclasses.dataclass(frozen=True)
class EvaluateOnMesh(EvaluateJob[Any]):
    plan: MeshPlan | None = None


@dataclasses.dataclass(frozen=True)
class PredictOnMesh(PredictJob[Any]):
    plan: MeshPlan | None = None


_ON_MESH: dict[type, type] = {FitJob: FitOnMesh, EvaluateJob: EvaluateOnMesh, PredictJob: PredictOnMesh}
_PLAIN = {on_mesh: plain for plain, on_mesh in _ON_MESH.items()}


def on_mesh(job: Job, plan: MeshPlan) -> Job:
    """``job`` run on ``plan``'s mesh."""
    return _ON_MESH[type(job)](**_fields(job), plan=plan)


def mesh_plan_of(job: Job) -> MeshPlan | None:
    """The plan of a job on a mesh (None: plain data parallel)."""
    return job.plan if isinstance(job, (FitOnMesh, EvaluateOnMesh, PredictOnMesh)) else None


def _fields(job: Job) -> dict[str, Any]:
    base = _PLAIN.get(type(job), type(job))
    return {field.name: getattr(job, field.name) for field in dataclasses.fields(base)}


def _quiet(job: Job) -> Job:
    """``job`` with no progress bar nor callbacks (History's, a ProgbarLogger's: under torchrun every process
    has the caller's): for a process that is rank 0 of its column but not the caller."""
    if isinstance(job, FitJob):
        return dataclasses.replace(job, arguments=dataclasses.replace(job.arguments, verbose=0))
    return dataclasses.replace(job, verbose=0, callbacks=())


def run_on_mesh(
    model: keras.Model,
    job: Job,
    replica: Replica,
    plan: MeshPlan,
    *,
    sync: bool,
    build: Callable[[keras.Model, Job], None],
    same_streams: Callable[[Replica], None],
    run: Callable[..., Any],
    scoping: Scoping | None = None,
) -> Any:
    """``job`` on this process of ``plan``'s mesh (``replica``: its place among all the mesh's processes).

    Every process first takes the caller's whole state and random streams (``build``, ``same_streams``:
    ``_loop.run``'s), then ``run``s the plain job as its column's replica with its row's layers split.
    A model built in the trainer's scope (``scoping``) is made by parts instead, at its first call, and
    keeps its parts between calls."""
    if scoping is not None and not scoping.scoped(model):
        scoping = None
    with contextlib.nullcontext() if scoping is None else scoping.calling():  # its own parts read, not gathered
        return _run(model, job, replica, plan, sync=sync, build=build, same_streams=same_streams, run=run,
                    scoping=scoping)  # fmt: skip


def _run(
    model: keras.Model,
    job: Job,
    replica: Replica,
    plan: MeshPlan,
    *,
    sync: bool,
    build: Callable[[keras.Model, Job], None],
    same_streams: Callable[[Replica], None],
    run: Callable[..., Any],
    scoping: Scoping | None,
) -> Any:
    places = mesh_places(replica, plan.mesh)
    plain = _PLAIN[type(job)](**_fields(job))
    trains = isinstance(job, FitJob)
    if scoping is not None:  # its parts made at its first call, the rest whole
        axes = split_axes(model, plan)
        scoping.prepare(
            model, replica, lambda: build(model, plain), axes, column=places.row.rank, columns=plan.mesh.columns,
            rows=plan.mesh.rows, trains=trains, sync=sync and replica.distributed,
        )  # fmt: skip
    else:
        build(model, plain)
        if sync:  # the caller's model, whole, on every process of the mesh
            check_same_variables(model, replica, optimizer=trains)
            same_state_as_primary(model, replica, optimizer=trains)
    same_streams(replica)  # every process of a row draws the same dropout masks
    if scoping is not None:  # the caller probed the add_loss terms (its weights read whole, one at a time)
        adopt_batch_terms(
            model, broadcast_object(batch_terms(model, plain.inputs) if replica.is_primary else None, replica)
        )
    else:
        # the loop's probe of the model's add_loss terms runs it on single rows, once per model (cached): here,
        # whole, on every process, rather than split on the processes whose model has not run it yet
        batch_terms(model, plain.inputs)
    if places.column.is_primary and not replica.is_primary:
        plain = _quiet(plain)
    optimizer = model.optimizer if trains else None

    def run_split(job: Job) -> Any:
        with split_layers(model, plan, places.row, optimizer=optimizer, parts_held=scoping is not None):
            return run(model, job, places.column, sync=False)

    # whole between epochs, checkpoints and callbacks there (_mesh.epochs); a scoped model stays in parts
    if isinstance(plain, FitJob):
        return fit_by_epochs(
            model, plain, replica, column=places.column, rows=plan.mesh.rows, run_epoch=run_split, scoping=scoping
        )
    return run_split(plain)


def split_axes(model: keras.Model, plan: MeshPlan) -> tuple[tuple[int, int], ...]:
    """The variables ``plan`` splits (by identity) with their split axes: each split layer's weight, and its
    bias where it splits with the weight's columns."""
    layers = splittable_layers(model)
    axes: list[tuple[int, int]] = []
    for split in plan.splits:
        layer = layers[split.layer]
        axes.append((id(weight_of(layer)), split.dimension))
        bias = bias_of(layer)
        if split.bias_split and bias is not None:
            axes.append((id(bias), 0))
    return tuple(axes)
