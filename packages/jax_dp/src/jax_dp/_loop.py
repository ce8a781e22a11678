"""The host-side loops: Keras's ``fit``/``evaluate``/``predict`` loops over the jitted steps.

Callbacks and the progress bar run on process 0 only; every decision process 0 makes
(stop) reaches every process at a step all of them agree on. The state lives on the mesh
during an epoch and in the caller's model around the callbacks that end it (``_state``).

``fit_loop`` is the loop over epochs for any step: it takes how an epoch trains
(``EpochTrainer``, ``_epochs``) and how validation runs (``Evaluator``): Keras's own steps here
(``evaluate_loop``), a model's own in ``_custom_loop``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
import keras
import numpy as np
from jax.sharding import Mesh

from dp_core import ReplicaLayout
from dp_core.keras import (
    BatchSource,
    CheckpointWriter,
    FitArguments,
    Start,
    callback_list,
    internals,
)
from jax_dp._batches import Plan, device_batches
from jax_dp._checkpoints import save
from jax_dp._distributed import agree, is_primary, rows_to_host, same_on_all_processes
from jax_dp._epochs import EpochTrainer
from jax_dp._hooks import BatchEndReporter, host_logs
from jax_dp._metrics import metrics_on_mesh
from jax_dp._optimizers import Optimizer
from jax_dp._sources import epoch_plan, steps_per_epoch
from jax_dp._state import Weights, weights_on_mesh
from jax_dp._steps import Steps


class Evaluator(Protocol):
    """Loss and metrics of the model's current weights over every batch of ``plan``, as
    ``model.evaluate`` logs them; batch-end ``callbacks`` as ``model.evaluate`` calls them."""

    def __call__(self, plan: Plan, callbacks: keras.callbacks.CallbackList | None) -> dict[str, Any]: ...


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
    """Every epoch from ``start``: train, validate, call back, checkpoint; returns the model's History."""
    callbacks = callback_list(
        arguments.callbacks,
        model,
        is_primary=is_primary(),
        verbose=arguments.verbose,
        epochs=arguments.epochs,
        steps=steps_per_epoch(arguments.inputs, arguments.global_batch_size),
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
        plan = epoch_plan(
            arguments.inputs,
            layout=layout,
            global_batch_size=arguments.global_batch_size,
            epoch=epoch,
            seed=arguments.seed,
            shuffle=arguments.shuffle,
        )
        logs, optimizer_state = train_epoch(
            plan,
            callbacks,
            start=start if epoch == start.epoch else Start(epoch=epoch),  # a checkpoint's place is in its epoch
            optimizer_state=optimizer_state,
        )
        if arguments.validates_after(epoch):
            assert arguments.validation is not None
            validation = epoch_plan(
                arguments.validation, layout=layout, global_batch_size=arguments.validation_global_batch_size
            )
            callbacks.on_test_begin()  # the fit's callbacks get the test hooks, as in model.fit
            val_logs = evaluate(validation, callbacks)
            callbacks.on_test_end(val_logs)
            logs.update({f"val_{name}": value for name, value in val_logs.items()})
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


def _initial_epoch(model: keras.Model, initial_epoch: int) -> int:
    """The first epoch, as ``model.fit`` reads it after ``on_train_begin``: one a callback set
    (``BackupAndRestore`` restoring an interrupted run), else ``initial_epoch``; process 0's."""
    chosen = internals.initial_epoch_override(model) or initial_epoch
    return int(same_on_all_processes([np.asarray(chosen)])[0])


def evaluate_loop(
    model: keras.Model,
    steps: Steps,
    plan: Plan,
    mesh: Mesh,
    callbacks: keras.callbacks.CallbackList | None = None,
) -> dict[str, Any]:
    """Loss and metrics of the model's current weights over every sample of the plan (running
    means over real rows); batch-end ``callbacks`` as ``model.evaluate`` calls them."""
    weights = weights_on_mesh(model, mesh)
    metrics = metrics_on_mesh(model, mesh)
    reporter = None if callbacks is None else BatchEndReporter(callbacks, "test", plan.steps)
    for step, batch in enumerate(device_batches(plan, mesh)):
        metrics = steps.test(weights, metrics, batch, plan.padded)
        if reporter is not None and callbacks is not None and reporter.due(step):
            callbacks.on_test_batch_end(step, host_logs(steps.results(metrics)))
    return host_logs(steps.results(metrics))


def predict_loop(
    predict_step: Callable[[Weights, Any], Any],
    model: keras.Model,
    plan: Plan,
    mesh: Mesh,
    callbacks: keras.callbacks.CallbackList,
) -> Any:
    """The model's outputs for every sample, in the plan's (input) order, padding dropped."""
    build_for_predict(model, plan)
    weights = weights_on_mesh(model, mesh)
    reporter = BatchEndReporter(callbacks, "predict", plan.steps)
    outputs = []
    for step, batch in enumerate(device_batches(plan, mesh)):
        outputs.append(predict_step(weights, batch.x))
        if reporter.due(step):
            real = plan.real_rows(step)  # the batch's outputs as model.predict hands them over: no padding
            batch_outputs = jax.tree.map(lambda output, real=real: output[:real], outputs[-1])
            callbacks.on_predict_batch_end(step, {"outputs": batch_outputs})
    # Pulled at the end, not per batch, so the devices never wait for the host.
    host = [_real_rows_to_host(output, plan.real_rows(step)) for step, output in enumerate(outputs)]
    return jax.tree.map(lambda *parts: np.concatenate(parts), *host)


def build_for_predict(model: keras.Model, plan: Plan) -> None:
    """A model whose layers are not all built (a subclassed model after ``build(shape)``) is
    called once on the first rows, as ``model.predict`` does, so no variable is created inside
    the jitted step."""
    if not all(layer.built for layer in internals.flatten_layers(model, include_self=True)):
        x, _, _ = plan.inputs.first_rows()
        with keras.StatelessScope():  # creates the variables, changes no state
            model(x)


def _real_rows_to_host(output: Any, real_rows: int) -> Any:
    return jax.tree.map(lambda leaf: rows_to_host(leaf)[:real_rows], output)
