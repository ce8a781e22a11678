"""A call on a mesh: its job marked with the call's ``MeshPlan`` (``on_mesh``), and what every process
of the mesh runs for it (``run_on_mesh``).

A job on a mesh is one of ``dp_core.keras``'s jobs with the plan added (a subclass, so every
``isinstance`` and ``dataclasses.replace`` that reads or copies a job keeps it, the way to the
workers included). ``_loop.run.run_job`` hands it here, and gets the job without its plan back to run
as plain data parallel over the process's mesh column, its split layers in place: each mesh row is one
replica, and its processes read the same rows, draw the same noise and compute the same logs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras

from dp_core.keras import EvaluateJob, FitJob, Job, PredictJob, batch_terms
from torch_dp._comm.replica import Replica
from torch_dp._mesh.epochs import fit_by_epochs
from torch_dp._mesh.groups import mesh_places
from torch_dp._mesh.layers import split_layers
from torch_dp._mesh.plan import MeshPlan
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
) -> Any:
    """``job`` on this process of ``plan``'s mesh (``replica``: its place among all the mesh's processes).

    Every process first takes the caller's whole state and random streams (``build``, ``same_streams``:
    ``_loop.run``'s), then ``run``s the plain job as its column's replica with its row's layers split."""
    places = mesh_places(replica, plan.mesh)
    plain = _PLAIN[type(job)](**_fields(job))
    build(model, plain)
    trains = isinstance(job, FitJob)
    if sync:  # the caller's model, whole, on every process of the mesh
        check_same_variables(model, replica, optimizer=trains)
        same_state_as_primary(model, replica, optimizer=trains)
    same_streams(replica)  # every process of a row draws the same dropout masks
    # the loop's probe of the model's add_loss terms runs it on single rows, once per model (cached): here,
    # whole, on every process, rather than split on the processes whose model has not run it yet
    batch_terms(model, plain.inputs)
    if places.column.is_primary and not replica.is_primary:
        plain = _quiet(plain)
    optimizer = model.optimizer if trains else None

    def run_split(job: Job) -> Any:
        with split_layers(model, plan, places.row, optimizer=optimizer):
            return run(model, job, places.column, sync=False)

    if isinstance(plain, FitJob):  # whole between epochs: checkpoints and callbacks there (_mesh.epochs)
        return fit_by_epochs(model, plain, replica, column=places.column, rows=plan.mesh.rows, run_epoch=run_split)
    return run_split(plain)
