"""Running a job on one replica: the caller's model made ready (built, its losses checked, its
variables on this replica's device, rank 0's state everywhere), then the job's loop.

``run_job`` serves every replica: the caller's own process (one replica, rank 0 of spawned
replicas, or one of torchrun's) and each spawned worker. Jobs are data (``dp_core.keras``'s); what each
kind of job does on a replica is here (``run_fit``, ``run_evaluate``, ``run_predict``).
"""

from __future__ import annotations

from typing import Any, cast

import keras
import numpy as np
import torch

from dp_core import NO_STEP_TIMER, PreemptionWatch, ShardMode, StepTimer
from dp_core.keras import (
    CheckpointWriter,
    EvaluateJob,
    FitJob,
    Inputs,
    Job,
    PredictJob,
    adopt_batch_terms,
    batch_terms,
    build_model,
    check_losses_split,
    learning_rate_policy_installed,
)
from torch_dp._comm.collectives import all_gather_rows, all_gather_varying_rows, broadcast_object
from torch_dp._comm.replica import Replica
from torch_dp._data.order import in_batch_order, in_even_order, in_input_order
from torch_dp._data.sources import Readable
from torch_dp._loop.checkpoints import resume_from
from torch_dp._loop.evaluate import evaluate_loop, predict_loop
from torch_dp._loop.fit import fit_loop
from torch_dp._loop.loader_draws import build_drawing, job_loader
from torch_dp._mesh.run import mesh_plan_of, run_on_mesh
from torch_dp._scope.deferred import scoped_mode
from torch_dp._scope.held import calling
from torch_dp._scope.replicas import ON_MESH, prepared, sync_whole_ones, weights_by_layer
from torch_dp._step.batchnorm import masked_batch_norm
from torch_dp._step.broadcast import check_same_variables, same_state_as_primary
from torch_dp._step.custom import custom_steps, overrides
from torch_dp._step.flops import COUNTED, flops_per_step, rows_to_count
from torch_dp._step.owners import Piece
from torch_dp._step.placement import check_placement
from torch_dp._step.profile import finish_report, step_timer, timing_batch_norm
from torch_dp._step.shards import sharded
from torch_dp._step.streams import same_random_streams


def build(model: keras.Model, job: Job) -> None:
    """Create every variable the job needs (model, metrics, optimizer) from a couple of rows, and where
    ``model.fit`` or ``evaluate`` would build it from a batch, draw what its torch loader draws for it
    (``_loop.loader_draws``; on rank 0, whose torch generator every replica then takes)."""
    if isinstance(job, PredictJob):  # model.predict builds on its first batch: no batch of its own
        build_model(model, job.inputs, for_predict=True)
        return
    build_drawing(model, lambda: build_model(model, job.inputs), job_loader(job))


def check_losses(model: keras.Model, job: Job, num_replicas: int) -> None:
    """Before any step: a compiled loss that reduces over the batch axis cannot be split over
    replicas or padded rows, a clear error (``dp_core.keras.check_losses_split``). A model's
    own step computes its loss itself, on its replica's rows, unpadded: nothing to check."""
    if isinstance(job, FitJob):
        arguments = job.arguments
        scored = [] if overrides(model, "train_step") else [(arguments.inputs, arguments.global_batch_size)]
        if arguments.validation is not None and not overrides(model, "test_step"):
            scored.append((arguments.validation, arguments.validation_global_batch_size))
    elif isinstance(job, EvaluateJob) and not overrides(model, "test_step"):
        scored = [(job.inputs, job.global_batch_size)]
    else:
        return
    if scored and (num_replicas > 1 or any(_padded(inputs, size) for inputs, size in scored)):
        check_losses_split(model, scored[0][0])


def _padded(inputs: Readable, global_batch_size: int) -> bool:
    """Whether a batch of ``inputs`` will be padded (a source's last batch may be short)."""
    return not isinstance(inputs, Inputs) or inputs.num_samples % global_batch_size != 0


def run_job(model: keras.Model, job: Job, replica: Replica, *, sync: bool = True) -> Any:
    """Run ``job`` on ``model`` as ``replica``. With ``sync`` every replica first takes rank 0's
    state (a persistent worker whose model already equals rank 0's skips it)."""
    if (plan := mesh_plan_of(job)) is not None:  # each mesh row one replica, its Dense layers split (_mesh)
        return run_on_mesh(
            model, job, replica, plan, sync=sync, build=build, same_streams=same_random_streams, run=run_job,
            scoping=ON_MESH,
        )  # fmt: skip
    scoped, mode = scoped_mode(model)
    if scoped:
        with calling():
            return _run_scoped(model, job, replica, mode, sync=sync)
    build(model, job)
    check_losses(model, job, replica.num_replicas)
    check_placement(model, replica)  # a collective: every replica stops if one's variables are elsewhere
    if replica.distributed and sync:  # the same start on every replica, whatever built the model
        check_same_variables(model, replica, optimizer=isinstance(job, FitJob))
        same_state_as_primary(model, replica, optimizer=isinstance(job, FitJob))
    if replica.distributed:  # every call: the caller may have set torch's generator since the last one
        same_random_streams(replica)
    if isinstance(job, FitJob):
        return run_fit(model, job, replica)
    if isinstance(job, EvaluateJob):
        return run_evaluate(model, job, replica)
    return run_predict(model, job, replica)


def _run_scoped(model: keras.Model, job: Job, replica: Replica, mode: ShardMode | None, *, sync: bool) -> Any:
    """``run_job`` for a model built in a trainer's scope: its new variables made by parts, its parts
    kept by their holders before and after (``_scope``)."""
    layout = prepared(model, mode, replica, lambda: build(model, job), trains=isinstance(job, FitJob))
    check_placement(model, replica)
    if replica.distributed and sync:  # the caller may have assigned what every replica holds whole
        sync_whole_ones(model, layout, replica, trains=isinstance(job, FitJob))
    if replica.distributed:
        same_random_streams(replica)
    # the caller probed the model's add_loss terms (reading each weight whole); its replicas take its answer
    terms = broadcast_object(batch_terms(model, job.inputs) if replica.is_primary else None, replica)
    adopt_batch_terms(model, terms)
    with weights_by_layer(model, layout, replica):
        check_losses(model, job, replica.num_replicas)
        if isinstance(job, EvaluateJob):
            return run_evaluate(model, job, replica)
        if isinstance(job, PredictJob):
            return run_predict(model, job, replica)
    assert isinstance(job, FitJob)
    return run_fit(model, job, replica, held=list(layout.pieces) if layout.mode is not None else None)


def run_fit(
    model: keras.Model, job: FitJob, replica: Replica, *, held: list[Piece] | None = None
) -> keras.callbacks.History:
    """``fit`` on this replica; returns its History (with the scaling report when profiled). ``held``:
    a scoped model's pieces, which its replicas hold before the fit and keep after."""
    with (
        masked_batch_norm(model, job.batch_norm, replica),
        learning_rate_policy_installed(model.optimizer, job.lr_policy),
        custom_steps(model, replica, ("train_step", "test_step")) as custom,
        PreemptionWatch() as notice,
    ):
        # after the policy: the checkpoint's rate wins
        start = resume_from(job.resume_from, model, replica, by_parts=held is not None)
        writer = None
        if job.arguments.checkpoint_dir is not None:
            writer = CheckpointWriter(
                job.arguments.checkpoint_dir,
                job.arguments.checkpoint_every_steps,
                seed=job.arguments.seed,
                global_batch_size=job.arguments.global_batch_size,
                num_replicas=replica.num_replicas,
                lr_policy=None if job.lr_policy is None else job.lr_policy.config(),
                in_background=job.arguments.checkpoint_in_background,
            )
        timer = NO_STEP_TIMER if job.profile is None else step_timer(replica)
        counted = job.profile is not None and replica.is_primary and not custom.train  # the MFU's FLOPs
        size = job.arguments.global_batch_size
        rows = rows_to_count(job.inputs, global_batch_size=size, num_replicas=replica.num_replicas) if counted else None
        if job.shard == "full" and held is None:  # its one-replica probe of the model runs now, on the whole weights
            batch_terms(model, job.inputs)
        with timing_batch_norm(timer), sharded(model, job.shard, replica, held) as state:
            history = fit_loop(
                model,
                job,
                replica,
                start=start,
                checkpoints=writer,
                custom=custom,
                notice=notice,
                timer=timer,
                state=state,
            )
        if isinstance(timer, StepTimer) and job.profile is not None:
            flops = None if rows is None else flops_per_step(model, rows, global_batch_size=size)
            report = finish_report(
                timer,
                model,
                replica,
                global_batch_size=size,
                folder=job.profile,
                shard=job.shard,
                flops_per_step=flops,
                flops_how=COUNTED,
            )
            history.scaling_report = report  # pyright: ignore[reportAttributeAccessIssue]
        return history


def run_evaluate(model: keras.Model, job: EvaluateJob, replica: Replica) -> dict[str, Any]:
    """``evaluate`` on this replica; returns the logs over every replica's rows."""
    with (
        masked_batch_norm(model, job.batch_norm, replica),
        custom_steps(model, replica, ("test_step",)) as custom,
    ):
        return evaluate_loop(
            model,
            job.inputs,
            job.global_batch_size,
            replica,
            callbacks=job.callbacks,
            verbose=job.verbose,
            log_every_steps=job.log_every_steps,
            custom=custom,
            executions=job.executions,
        )


def _tensor(leaf: Any) -> torch.Tensor:
    """``leaf`` as Keras converts it: numpy has no bfloat16 of torch's (ml_dtypes' is Keras's)."""
    return cast(torch.Tensor, keras.ops.convert_to_tensor(leaf))


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """``tensor`` as Keras's predict returns it (a bfloat16 one as ml_dtypes' bfloat16)."""
    return cast(np.ndarray, keras.ops.convert_to_numpy(tensor))


def run_predict(model: keras.Model, job: PredictJob, replica: Replica) -> Any:
    """``predict`` on this replica; returns every row's outputs, in input order, in the
    structure the model's (or its own ``predict_step``'s) outputs have."""
    with custom_steps(model, replica, ("predict_step",)) as custom:
        outputs, real_rows = predict_loop(
            model,
            job.inputs,
            job.global_batch_size,
            replica,
            callbacks=job.callbacks,
            verbose=job.verbose,
            custom=custom,
            executions=job.executions,
        )
    local = keras.tree.flatten(outputs)
    # gathered on every replica: one collective, and no replica needs to know which one reports
    gather = all_gather_varying_rows if custom.predict else all_gather_rows
    on_device = [_tensor(leaf).to(replica.device) for leaf in local]
    parts = [[_numpy(p) for p in gather(tensor, replica)] for tensor in on_device]
    by_rank = [[parts[leaf][rank] for leaf in range(len(local))] for rank in range(replica.num_replicas)]
    if custom.predict:  # no padding: each global batch's rows split evenly
        leaves = in_even_order(by_rank, real_rows)
    elif isinstance(job.inputs, Inputs):
        leaves = in_input_order(by_rank, job.inputs.num_samples, job.global_batch_size)
    else:
        leaves = in_batch_order(by_rank, real_rows, job.global_batch_size)
    return keras.tree.pack_sequence_as(outputs, leaves)
