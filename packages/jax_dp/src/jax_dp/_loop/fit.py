"""The fit loop: Keras's ``model.fit`` over epochs, for any kind of train step.

Callbacks and the progress bar run on process 0 only; every decision process 0 makes
(stop) reaches every process at a step all of them agree on. ``fit_loop`` takes how an epoch
trains (``EpochTrainer``, ``_loop.epochs``) and how validation runs (``Evaluator``, ``_loop.evaluate``).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from dp_core import EpochOrder, ReplicaLayout
from dp_core.keras import (
    BatchSource,
    CheckpointWriter,
    FitArguments,
    Start,
    callback_list,
    checkpoints_finished,
    internals,
)
from jax_dp._comm.hosts import agree, is_primary, same_on_all_processes
from jax_dp._data.sources import epoch_plan
from jax_dp._loop.checkpoints import holding_checkpoint_dir, save
from jax_dp._loop.epochs import EpochTrainer
from jax_dp._loop.evaluate import Evaluator
from jax_dp._step.optimizers import Optimizer


def fit_loop(
    model: keras.Model,
    arguments: FitArguments,
    *,
    optimizer: Optimizer,
    train_epoch: EpochTrainer,
    evaluate: Evaluator,
    layout: ReplicaLayout,
    start: Start,
    checkpoints: CheckpointWriter | None,
) -> keras.callbacks.History:
    """Every epoch from ``start``: train, validate, call back, checkpoint; returns the model's History.
    Process 0 holds ``checkpoint_dir`` throughout (``holding_checkpoint_dir``)."""
    with holding_checkpoint_dir(arguments.checkpoint_dir), checkpoints_finished(checkpoints):
        callbacks = callback_list(
            arguments.callbacks,
            model,
            is_primary=is_primary(),
            verbose=arguments.verbose,
            epochs=arguments.epochs,
            steps=arguments.steps_shown,
            global_batch_size=arguments.global_batch_size,
        )
        model.stop_training = False
        optimizer_state = None  # kept on the mesh between epochs where the optimizer keeps it there (optax)
        logs: dict[str, Any] = {}
        callbacks.on_train_begin()
        if start.epoch or start.step:  # History continues from the checkpoint
            model.history.epoch, model.history.history = list(range(start.epoch)), start.history
        else:
            start = Start(epoch=_initial_epoch(model, arguments.initial_epoch))
        for epoch in range(start.epoch, arguments.epochs):
            model.reset_metrics()  # before the hook, as in model.fit
            callbacks.on_epoch_begin(epoch)
            plan = epoch_plan(arguments.inputs, layout=layout, order=arguments.epoch_order(epoch))
            logs, optimizer_state = train_epoch(
                plan,
                callbacks,
                start=start if epoch == start.epoch else Start(epoch=epoch),  # a checkpoint's place is in its epoch
                optimizer_state=optimizer_state,
            )
            if arguments.validates_after(epoch):
                logs.update(_validation_logs(model, arguments, evaluate, callbacks, layout=layout))
            callbacks.on_epoch_end(epoch, logs)
            if checkpoints is not None:
                save(checkpoints, model, optimizer, optimizer_state, epoch=epoch + 1, step=0)
            if isinstance(arguments.inputs, BatchSource) and arguments.inputs.exhausted:
                model.stop_training = True  # an iterator that ran out ends training, as in Keras
            if agree(bool(model.stop_training)):
                model.stop_training = True
                break
        if arguments.epochs > start.epoch:
            optimizer.finish(model)
        callbacks.on_train_end(logs)
        return model.history


def _validation_logs(
    model: keras.Model,
    arguments: FitArguments,
    evaluate: Evaluator,
    callbacks: keras.callbacks.CallbackList,
    *,
    layout: ReplicaLayout,
) -> dict[str, Any]:
    """Validation at an epoch's end, as ``model.fit`` runs it: the fit's callbacks get the test
    hooks; its logs named ``val_...``."""
    assert arguments.validation is not None
    order = EpochOrder.in_input_order(arguments.validation_global_batch_size)
    plan = epoch_plan(arguments.validation, layout=layout, order=order)
    model.stop_evaluating = False  # as model.fit's evaluate sets it, before the first test hook
    callbacks.on_test_begin()
    val_logs = evaluate(plan, callbacks, arguments.executions)  # in the fit's groups, as model.fit's
    callbacks.on_test_end(val_logs)
    return {f"val_{name}": value for name, value in val_logs.items()}


def _initial_epoch(model: keras.Model, initial_epoch: int) -> int:
    """The first epoch, as ``model.fit`` reads it after ``on_train_begin``: one a callback set
    (``BackupAndRestore`` restoring an interrupted run), else ``initial_epoch``; process 0's."""
    chosen = internals.initial_epoch_override(model) or initial_epoch
    return int(same_on_all_processes([np.asarray(chosen)])[0])
