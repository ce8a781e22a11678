"""A fit on a mesh, one epoch at a time (``fit_by_epochs``): each epoch is a fit of its own on the split
layers, and between epochs every process holds the whole model again, where a fit on one device stands
after an epoch. There the checkpoint is written and the caller's callbacks run, on rank 0 (the caller),
on whole variables, and what they decide reaches every process of the mesh.

- Checkpoints are data parallel's (``dp_core``'s format, whole variables, written atomically by rank 0
  alone, which holds ``checkpoint_dir`` for the fit), so a fit resumes from one on any mesh shape or on
  plain data parallel, and from theirs written at an epoch's end. A resumed fit restores rank 0's model
  and every process takes its state before any layer is split.
- Callbacks: ``on_train_begin``, ``on_epoch_begin``, ``on_epoch_end`` and ``on_train_end`` run here. After
  a hook some callback acts at, rank 0's stop and its whole state (weights, optimizer variables, learning
  rate included) go to every process: one broadcast of the state per such hook, none without callbacks.
  Hooks inside an epoch (batches, validation) would read split variables: refused in the caller
  (``_mesh.checks``), but History's and the progress bar's.

A model built in the trainer's scope stays in parts between epochs too: its checkpoints are written by parts
(each process of the mesh's first row its own parts, rank 0 the rest: ``Scoping.save``) and restored by parts
(``Scoping.put``), and it is given no acting callback (refused in the caller), so nothing here reads or sends
its split variables whole.

Each epoch's fit runs with a callback that ends it at its epoch's end (``OneEpoch``), so its progress bar
says "Epoch 3/5" as the whole fit's would. What a fit draws from torch's generator (Keras's loader starts
an iteration at each epoch), its data order (by epoch) and its optimizer's step count go on from one
epoch to the next as within one fit. This module is outside ``_loop`` (the loop runs it), so it uses
``dp_core``'s checkpoint pieces and the collectives directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras

from dp_core import claim_checkpoint_dir, load_checkpoint
from dp_core.keras import (
    CheckpointWriter,
    FitJob,
    Start,
    callback_list,
    checkpoint_pairs,
    checkpoints_finished,
    internals,
    restore_model,
    start_of,
)
from torch_dp._comm.collectives import all_reduce_sum, broadcast_object
from torch_dp._comm.replica import Replica
from torch_dp._mesh.scoping import Scoping
from torch_dp._step.broadcast import same_state_as_primary
from torch_dp._step.streams import put_streams_back, random_streams

EPOCH_HOOKS = ("on_train_begin", "on_epoch_begin", "on_epoch_end", "on_train_end")
PASSIVE = (keras.callbacks.History, keras.callbacks.ProgbarLogger)  # they read the logs only


class OneEpoch(keras.callbacks.Callback):
    """Ends the fit it is given to at its first epoch's end (the mesh's epochs are fits of their own),
    noting whether that fit had stopped itself (``stopped``: a non-finite loss's stop)."""

    stopped = False

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        model: Any = self.model
        self.stopped = bool(model.stop_training)
        model.stop_training = True


def fit_by_epochs(
    model: keras.Model,
    job: FitJob[Any],
    replica: Replica,
    *,
    column: Replica,
    rows: int,
    run_epoch: Callable[[FitJob[Any]], Any],
    scoping: Scoping | None = None,
) -> keras.callbacks.History:
    """``job`` on ``model``, whole on this process (``replica``: its place among the mesh's processes,
    ``column``: among its column's, ``rows``: the mesh's rows), one epoch at a time: ``run_epoch`` runs
    a fit of one epoch on the split layers. Returns the whole fit's History (rank 0's is the caller's).
    ``scoping``: the model was built in the trainer's scope, and its checkpoints are written and read by parts."""
    arguments = job.arguments
    start = _resumed(job, model, replica, scoping)
    writer = None
    if arguments.checkpoint_dir is not None and replica.is_primary:
        policy = None if job.lr_policy is None else job.lr_policy.config()
        writer = CheckpointWriter(
            arguments.checkpoint_dir, None, arguments.seed, arguments.global_batch_size, rows, policy,
            in_background=arguments.checkpoint_in_background,
        )  # fmt: skip
    callbacks = callback_list(
        arguments.callbacks, model, is_primary=replica.is_primary, verbose=0, epochs=arguments.epochs,
        steps=arguments.steps_shown, global_batch_size=arguments.global_batch_size,
    )  # fmt: skip
    history = next(c for c in callbacks.callbacks if isinstance(c, keras.callbacks.History))  # the whole fit's
    # rank 0's: the other processes may not have the caller's callbacks (they run on rank 0 only)
    acting = broadcast_object(acting_hooks(arguments.callbacks) if replica.is_primary else None, replica)
    logs: dict[str, Any] = {}
    with _holding(arguments.checkpoint_dir, replica), checkpoints_finished(writer):
        model.stop_training = False
        callbacks.on_train_begin()
        if start.epoch:  # the History continues from the checkpoint's
            history.epoch, history.history = list(range(start.epoch)), dict(start.history)
        _decided(model, replica, "on_train_begin" in acting)
        if start.epoch:  # torch's generator as the checkpoint's epoch end left it (``_step.streams``)
            put_streams_back(start, replica)
        for epoch in range(max(start.epoch, arguments.initial_epoch), arguments.epochs):
            callbacks.on_epoch_begin(epoch)
            if _decided(model, replica, "on_epoch_begin" in acting):
                break
            one_epoch = OneEpoch()
            logs = {name: values[-1] for name, values in run_epoch(_one_epoch(job, epoch, one_epoch)).history.items()}
            model.stop_training, model.history = one_epoch.stopped, history
            callbacks.on_epoch_end(epoch, logs)
            if arguments.checkpoint_dir is not None:
                metric_variables = all_reduce_sum([v.value for v in model.metrics_variables], column)
                streams = random_streams(replica)
                if scoping is not None:  # every process writes its own parts, rank 0 the rest
                    scoping.save(
                        writer, model, replica, epoch=epoch + 1, step=0, metric_variables=metric_variables,
                        random_streams=streams,
                    )  # fmt: skip
                elif writer is not None:
                    writer.write(
                        model, epoch=epoch + 1, step=0, metric_variables=metric_variables, random_streams=streams
                    )
            if _decided(model, replica, "on_epoch_end" in acting):  # a callback's stop, or a non-finite loss's
                break
        callbacks.on_train_end(logs=logs)
        _decided(model, replica, "on_train_end" in acting)  # EarlyStopping's best weights, everywhere
    return history


def acting_hooks(callbacks: Sequence[keras.callbacks.Callback] | None) -> set[str]:
    """The hooks of ``EPOCH_HOOKS`` that some callback but History and the progress bar overrides."""
    acting = [c for c in callbacks or [] if not isinstance(c, PASSIVE)]
    return {hook for hook in EPOCH_HOOKS if any(internals.overrides_hook(c, hook) for c in acting)}


def _decided(model: keras.Model, replica: Replica, acted: bool) -> bool:
    """Rank 0's stop on every process, and with ``acted`` (its callbacks acted at the hook just run) its
    whole state; returns the stop."""
    stop = bool(broadcast_object(bool(model.stop_training), replica))
    if acted:
        same_state_as_primary(model, replica, optimizer=True)
    model.stop_training = stop
    return stop


def _one_epoch(job: FitJob[Any], epoch: int, one_epoch: OneEpoch) -> FitJob[Any]:
    """``job`` as the fit of its epoch ``epoch`` alone, with no checkpoint and ``one_epoch`` its only callback."""
    arguments = dataclasses.replace(
        job.arguments, initial_epoch=epoch, callbacks=(one_epoch,), checkpoint_dir=None, checkpoint_every_steps=None
    )
    return dataclasses.replace(job, arguments=arguments, resume_from=None)


def _resumed(job: FitJob[Any], model: keras.Model, replica: Replica, scoping: Scoping | None) -> Start:
    """Where the fit starts: rank 0 restores its ``job.resume_from`` (chosen and checked in the caller; under
    torchrun only rank 0's caller chooses one) into the whole model and every process takes its state; a
    failure there stops every process. A scoped model's (``scoping``): rank 0 reads one array at a time and
    every process takes its part."""
    start, failure, values = Start(), None, {}
    if replica.is_primary and job.resume_from is not None:
        try:
            checkpoint = load_checkpoint(job.resume_from, lazily=scoping is not None)
            if scoping is None:
                restore_model(checkpoint, model, metrics=False)
            else:  # each array read when its turn comes
                values = {id(v): value for v, value in checkpoint_pairs(checkpoint, model, metrics=False)}
            start = start_of(checkpoint)
        except Exception as error:  # every process must hear of it, or the others would wait for rank 0
            failure = error
    told = None if failure is None else repr(failure)
    path, epoch, step, told = broadcast_object((job.resume_from, start.epoch, start.step, told), replica)
    if failure is not None:
        raise failure
    if told is not None:
        raise RuntimeError(f"torch_dp: rank 0 could not resume from {path!r} ({told}); every process stops.")
    if step:
        raise ValueError(
            f"torch_dp: the checkpoint {path!r} was written {step} step(s) into epoch {epoch + 1} (by "
            "checkpoint_every_steps or a preemption of a data-parallel fit), and a fit on a mesh resumes at an "
            "epoch's end only. Resume it without mesh= to that epoch's end first, or remove that checkpoint."
        )
    if path is not None and scoping is not None:
        scoping.put(model, values, replica)
    elif path is not None:
        same_state_as_primary(model, replica, optimizer=True)  # rank 0's restored weights and optimizer state
    return start if replica.is_primary else Start(epoch)


@contextlib.contextmanager
def _holding(checkpoint_dir: str | None, replica: Replica) -> Iterator[None]:
    """Rank 0 holds ``checkpoint_dir`` for the fit (``dp_core.claim_checkpoint_dir``); a folder it cannot
    hold stops every process before the first step."""
    if checkpoint_dir is None:
        yield
        return
    with contextlib.ExitStack() as held:
        failure = None
        if replica.is_primary:
            try:
                held.enter_context(claim_checkpoint_dir(checkpoint_dir))
            except Exception as error:  # every process must hear of it
                failure = error
        told = broadcast_object(None if failure is None else repr(failure), replica)
        if failure is not None:
            raise failure
        if told is not None:
            raise RuntimeError(f"torch_dp: rank 0 cannot write checkpoint_dir ({told}); every process stops.")
        yield
