"""The fit loop every replica runs: Keras's ``fit`` (callbacks, epochs, validation, checkpoints
at each epoch end), each epoch's steps run by ``_loop.epochs.train_epoch``. Callbacks and the
progress bar run on rank 0 only; its decisions reach every replica (``_loop.epochs.share_decisions``),
and so does what its callbacks change in the model or optimizer at any hook (``_loop.changes``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import keras

from dp_core import NO_STEP_TIMER, NoStepTimer, PreemptionWatch, StepTimer
from dp_core.keras import (
    BatchSource,
    CheckpointWriter,
    FitJob,
    Start,
    callback_list,
    checkpoints_finished,
    internals,
    needs_every_batch,
    print_resume,
    verbosity,
)
from torch_dp._comm.collectives import broadcast_floats
from torch_dp._comm.replica import Replica
from torch_dp._loop.changes import Changes
from torch_dp._loop.checkpoints import check_same_start, holding_checkpoint_dir, restore_metrics, save
from torch_dp._loop.epochs import EpochSteps, KerasSteps, OwnSteps, share_decisions, train_epoch
from torch_dp._loop.evaluate import evaluate_loop
from torch_dp._loop.hooks import on_whole_state
from torch_dp._loop.loader_draws import KerasLoader, NoDraws, job_loader
from torch_dp._step.accumulation import Window, accumulation_window
from torch_dp._step.custom import CustomSteps
from torch_dp._step.shards import REPLICATED, TrainingState
from torch_dp._step.streams import put_streams_back


def fit_loop(
    model: keras.Model,
    job: FitJob,
    replica: Replica,
    *,
    start: Start,
    checkpoints: CheckpointWriter | None = None,
    custom: CustomSteps | None = None,
    notice: PreemptionWatch | None = None,
    timer: StepTimer | NoStepTimer = NO_STEP_TIMER,
    state: TrainingState = REPLICATED,
) -> keras.callbacks.History:
    """Train on this replica's shard of every epoch from ``start``; returns this replica's History.
    ``custom`` runs the model's own ``train_step``/``test_step`` where it has them. A preemption
    ``notice`` to any replica stops all at the next step: a checkpoint, then ``Preempted``. ``timer``
    (``Trainer(profile=...)``) times the phases of Keras's own train steps. Rank 0 holds
    ``checkpoint_dir`` from before the first step to the end (``holding_checkpoint_dir``). ``state``
    is the training state as the replicas hold it: whole on each, or sharded (``_step.shards``)."""
    arguments = job.arguments
    with holding_checkpoint_dir(arguments.checkpoint_dir, replica), checkpoints_finished(checkpoints):
        listed = callback_list(
            arguments.callbacks, model, is_primary=replica.is_primary, verbose=arguments.verbose,
            epochs=arguments.epochs, steps=arguments.steps_shown, global_batch_size=arguments.global_batch_size,
        )  # fmt: skip
        # sharded: rank 0's hooks see the whole state (a scoped model's served variable by variable)
        callbacks = on_whole_state(listed, arguments.callbacks, model, state, replica)
        logging = _batch_logging(job, replica)
        changes = Changes(model, replica, sharded=state.sharded_variables())
        resumed = bool(start.epoch or start.step)  # from a checkpoint (an initial_epoch comes later)
        start = _begin(model, callbacks, start, arguments.initial_epoch, replica, changes)
        if replica.is_primary:  # rank 0's checkpoint, which every replica resumed from
            print_resume(job.resume_from, start, epochs=arguments.epochs, verbose=arguments.verbose, package="torch_dp")
        window = _gradient_window(model, job, replica, custom, state)
        loader = job_loader(job)  # what Keras's torch loader draws from torch's generator, drawn alike
        epoch_logs: dict[str, Any] = {}
        for epoch in range(start.epoch, arguments.epochs):
            model.reset_metrics()
            first_step = start.step if epoch == start.epoch else 0
            if first_step:
                restore_metrics(model, start, replica)
            callbacks.on_epoch_begin(epoch)
            if share_decisions(model, replica, changes=changes):
                break
            kind = _epoch_steps(model, job, replica, custom, window, logging, state)
            timed = timer if isinstance(kind, KerasSteps) else NO_STEP_TIMER  # a model's own step is not timed
            _reading_begins(loader, replica, start if resumed and epoch == start.epoch else None)
            epoch_logs = train_epoch(
                model, job, epoch, replica, callbacks, kind,
                first_step=first_step, checkpoints=checkpoints, notice=notice, timer=timed, changes=changes,
            )  # fmt: skip
            if not model.stop_training:  # Keras's loader reads on to its end only in an epoch not stopped
                loader.epoch_ends()
            model.eval()
            if arguments.validates_after(epoch):
                epoch_logs.update(_validation_logs(model, job, replica, callbacks, custom, changes))
            callbacks.on_epoch_end(epoch, epoch_logs)
            if checkpoints is not None:
                save(checkpoints, model, replica, epoch=epoch + 1, step=0, window=window, state=state)
            if isinstance(job.inputs, BatchSource) and job.inputs.exhausted:
                model.stop_training = True  # an iterator that ran out ends training, as in Keras (rank 0 reads it)
            if share_decisions(model, replica, changes=changes):
                break
        if window is not None:  # the caller's model holds the accumulators as one device would
            window.settle(model, replica)
        state.gather()  # every replica's optimizer whole again, for the moving averages' swap and the caller
        if arguments.epochs > start.epoch:
            state.finalize_variable_values(model)
        callbacks.on_train_end(logs=epoch_logs)
        return model.history


def _reading_begins(loader: KerasLoader | NoDraws, replica: Replica, resumed: Start | None) -> None:
    """The draws of Keras's loader as an epoch begins; in the epoch a fit ``resumed`` from a checkpoint,
    torch's generator put back where the checkpoint left it: before those draws at an epoch's start,
    after them in its middle (the uninterrupted fit drew them before writing it)."""
    if resumed is not None and not resumed.step:
        put_streams_back(resumed, replica)
    loader.epoch_begins()
    if resumed is not None and resumed.step:
        put_streams_back(resumed, replica)


class BatchLogging(NamedTuple):
    """How a fit's batches are logged, as rank 0's callbacks and progress bar need it (every replica
    must agree on when metrics are summed, so rank 0's needs are shared)."""

    every: int  # the logs are summed every so many steps (0: never)
    each_step: bool  # a callback reads every batch's logs: they and rank 0's decisions travel with each step
    hooks: bool  # the batch hooks are called (a callback or a progress bar acts at a batch)


def _batch_logging(job: FitJob, replica: Replica) -> BatchLogging:
    callbacks = job.arguments.callbacks
    wants = [needs_every_batch(callbacks), verbosity(job.arguments.verbose) == 1]
    each_step, progress = (bool(flag) for flag in broadcast_floats(wants, replica))
    every = 1 if each_step else (job.log_every_steps if progress else 0)
    return BatchLogging(every, each_step, each_step or progress or _has_progress_bar(callbacks))


def _gradient_window(
    model: keras.Model, job: FitJob, replica: Replica, custom: CustomSteps | None, state: TrainingState
) -> Window | None:
    """The fit's gradient accumulation window: one gradient all-reduce per window (None: one per step).
    A window's non-finite loss is acted on at its end: raised, even with a TerminateOnNaN. Sharded, every
    step sums its gradients, and Keras accumulates each owner's own, as over one device's."""
    if (custom and custom.train) or state.mode:
        return None
    return accumulation_window(model, replica, "stop" if job.on_nonfinite_loss == "apply" else job.on_nonfinite_loss)


def _epoch_steps(
    model: keras.Model,
    job: FitJob,
    replica: Replica,
    custom: CustomSteps | None,
    window: Window | None,
    logging: BatchLogging,
    state: TrainingState = REPLICATED,
) -> EpochSteps:
    """How an epoch's steps run: the model's own ``train_step`` where it has one, else Keras's, logged as
    ``logging`` says."""
    if custom is not None and custom.train:
        return OwnSteps(model, replica, custom, log_every=logging.every)
    return KerasSteps(
        model,
        replica,
        window,
        logging.every,
        decide_each_step=logging.each_step,
        batch_hooks=logging.hooks,
        apply_nonfinite=job.on_nonfinite_loss == "apply",
        state=state,
    )


def _begin(
    model: keras.Model,
    callbacks: keras.callbacks.CallbackList,
    start: Start,
    initial_epoch: int,
    replica: Replica,
    changes: Changes,
) -> Start:
    """``on_train_begin``, then where training starts on every replica: the checkpoint's place (the
    History continues from it), or the first epoch (``_initial_epoch``)."""
    model.stop_training = False
    callbacks.on_train_begin()
    if start.epoch or start.step:  # History continues from the checkpoint
        model.history.epoch, model.history.history = list(range(start.epoch)), dict(start.history)
        changes.share()  # what ``on_train_begin`` changed on rank 0
    else:
        start = Start(epoch=_initial_epoch(model, initial_epoch, replica, changes))
    check_same_start(start, replica)  # rank 0 chose for all (``resume_from``); a last check before any step
    return start


def _validation_logs(
    model: keras.Model,
    job: FitJob,
    replica: Replica,
    callbacks: keras.callbacks.CallbackList,
    custom: CustomSteps | None,
    changes: Changes,
) -> dict[str, Any]:
    """The validation data's logs at an epoch end, named ``val_...``; the fit's callbacks get the test hooks."""
    assert job.validation is not None
    arguments = job.arguments
    val_logs = evaluate_loop(
        model,
        job.validation,
        arguments.validation_global_batch_size,
        replica,
        callbacks=arguments.callbacks,
        in_fit=callbacks,
        custom=custom,
        changes=changes,
        executions=arguments.executions,  # a fit's validation groups its steps as the fit
    )
    return {f"val_{name}": value for name, value in val_logs.items()}


def _initial_epoch(model: keras.Model, initial_epoch: int, replica: Replica, changes: Changes) -> int:
    """The first epoch, as ``model.fit`` reads it after ``on_train_begin``: one a callback set
    (``BackupAndRestore`` restoring an interrupted run), else ``initial_epoch``. Callbacks run on
    rank 0 and may have loaded weights there, so every replica takes rank 0's state (but for
    the random layers' seed states, which every replica advances alike: ``_loop.changes``)."""
    chosen = internals.initial_epoch_override(model) or initial_epoch
    (chosen,) = broadcast_floats([chosen], replica)
    changes.share()
    return int(chosen)


def _has_progress_bar(callbacks: Any) -> bool:
    """A ``ProgbarLogger`` the caller passed shows batches even with ``verbose=0``, as in Keras."""
    return any(isinstance(callback, keras.callbacks.ProgbarLogger) for callback in callbacks or [])
