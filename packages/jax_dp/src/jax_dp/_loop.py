"""The host-side loops: Keras's ``fit``/``evaluate``/``predict`` loops over the jitted steps.

Callbacks and the progress bar run on process 0 only; every decision process 0 makes
(stop) reaches every process at a step all of them agree on. The state lives on the mesh
during an epoch and in the caller's model around the callbacks that end it (``_state``).

``fit_loop`` is the loop over epochs for any step: it takes how an epoch trains
(``EpochTrainer``) and how validation runs (``Evaluator``): Keras's own steps here
(``keras_epochs``, ``evaluate_loop``), a model's own in ``_custom_loop``.
"""

from __future__ import annotations

import contextlib
import time
import warnings
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
    needs_every_batch,
    nonfinite_loss_stopped,
    python_logs,
    skipped_message,
)
from jax_dp import _preemption as preemption
from jax_dp._batches import Plan, device_batches
from jax_dp._checkpoints import save
from jax_dp._distributed import agree, is_primary, replicated_to_host, rows_to_host, same_on_all_processes
from jax_dp._metrics import Logs, metrics_on_mesh, summed_to_host
from jax_dp._optimizers import Optimizer
from jax_dp._profile import STEP, FitProfile
from jax_dp._sources import epoch_plan, steps_per_epoch
from jax_dp._state import (
    ModelOnRequest,
    TrainState,
    Weights,
    counts_on_host,
    optimizer_state_of,
    train_state_on_mesh,
    weights_on_mesh,
    write_back,
)
from jax_dp._steps import Steps, report_on_host
from jax_dp._steps_ahead import stepper

PROGRESS_SECONDS = 0.2  # progress-bar refresh: often enough to watch, rarely enough not to stall the devices
STOP_CHECK_STEPS = 16  # with several processes, how often a mid-epoch stop decision is exchanged


class BatchEndReporter:
    """Calls batch-end callbacks every step only if a callback needs every step.

    Otherwise (progress bar only) at most every ``PROGRESS_SECONDS`` and at the last
    step, because each report sums the metric states and waits for the devices. With
    several processes that sum is a collective, so every process reports at the same
    steps: every step if process 0 needs it, else every ``STOP_CHECK_STEPS``.
    """

    def __init__(self, callbacks: keras.callbacks.CallbackList, mode: str, steps: int | None) -> None:
        self.callbacks = callbacks
        self.steps = steps
        self.every_step = needs_every_batch(callbacks.callbacks, mode)  # type: ignore[arg-type]
        progress = any(isinstance(c, keras.callbacks.ProgbarLogger) for c in callbacks.callbacks)
        self.several_processes = jax.process_count() > 1
        if self.several_processes:
            self.every_step = agree(self.every_step)
        self.enabled = self.every_step or progress or self.several_processes
        self.last = 0.0

    def due(self, step: int) -> bool:
        if not self.enabled:
            return False
        if self.every_step or (self.steps is not None and step == self.steps - 1):
            return True
        if self.several_processes:
            return (step + 1) % STOP_CHECK_STEPS == 0
        if time.monotonic() - self.last >= PROGRESS_SECONDS:
            self.last = time.monotonic()
            return True
        return False


def host_logs(logs: Logs | None) -> dict[str, Any]:
    """Device logs as ``model.fit`` gives them: Python floats, numpy arrays for vector metrics."""
    return python_logs(replicated_to_host(logs)) if logs else {}


class EpochTrainer(Protocol):
    """Trains one epoch's ``plan`` from ``start`` (its epoch, and the step a checkpoint left it at);
    returns the epoch's logs and the optimizer state to start the next epoch from (None: read it
    from the model). The model holds the trained state afterwards."""

    def __call__(
        self, plan: Plan, callbacks: keras.callbacks.CallbackList, *, start: Start, optimizer_state: Any | None
    ) -> tuple[dict[str, Any], Any | None]: ...


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


def keras_epochs(
    model: keras.Model,
    *,
    optimizer: Optimizer,
    steps: Steps,
    mesh: Mesh,
    checkpoints: CheckpointWriter | None,
    stop_on_nonfinite: bool,
    profile: FitProfile | None = None,
) -> EpochTrainer:
    """Epochs of Keras's own train step (``_steps``); ``profile`` times their phases."""

    def train_epoch(
        plan: Plan, callbacks: keras.callbacks.CallbackList, *, start: Start, optimizer_state: Any | None
    ) -> tuple[dict[str, Any], Any]:
        return _train_epoch(
            model,
            plan,
            callbacks,
            start=start,
            optimizer=optimizer,
            optimizer_state=optimizer_state,
            steps=steps,
            mesh=mesh,
            checkpoints=checkpoints,
            stop_on_nonfinite=stop_on_nonfinite,
            profile=profile,
        )

    return train_epoch


def _train_epoch(
    model: keras.Model,
    plan: Plan,
    callbacks: keras.callbacks.CallbackList,
    *,
    start: Start,
    optimizer: Optimizer,
    optimizer_state: Any | None,
    steps: Steps,
    mesh: Mesh,
    checkpoints: CheckpointWriter | None,
    stop_on_nonfinite: bool,
    profile: FitProfile | None = None,
) -> tuple[dict[str, Any], Any]:
    """One epoch on the mesh from ``start.step``: its logs and the optimizer state it ends with.

    The model holds the trained weights afterwards, for the callbacks; the rest of the
    state is let go, so validation does not hold a second copy of the weights on the devices.
    """
    state = train_state_on_mesh(
        model,
        optimizer,
        mesh,
        previous_optimizer_state=optimizer_state,
        metric_sums=start.metric_variables if start.step else None,
        accumulate=True,
    )

    def checkpoint(state: TrainState, steps_done: int) -> None:
        assert checkpoints is not None
        sums = summed_to_host(state.metrics, mesh)  # a collective: every process
        write_back(model, optimizer, state)
        optimizer_state = optimizer_state_of(model, optimizer, state)  # mid-window: one device's accumulators
        save(checkpoints, model, optimizer, optimizer_state, epoch=start.epoch, step=steps_done, metric_variables=sums)

    try:
        state = _train_steps(
            steps,
            state,
            plan,
            mesh,
            model,
            callbacks,
            optimizer=optimizer,
            start=start.step,
            stop_on_nonfinite=stop_on_nonfinite,
            checkpoint=None if checkpoints is None else checkpoint,
            checkpoint_due=None if checkpoints is None else lambda done: checkpoints.due(done, plan.steps),
            profile=profile,
        )
    except preemption.StoppedAt as stop:
        raise preemption.preempted(
            stop,
            epoch=start.epoch,
            write_back=lambda state: write_back(model, optimizer, state),
            checkpoint=None if checkpoints is None else checkpoint,
            directory=None if checkpoints is None else checkpoints.directory,
        ) from None
    write_back(model, optimizer, state)
    check_skipped(state, start, stop_on_nonfinite=stop_on_nonfinite)
    return host_logs(steps.results(state.metrics)), optimizer_state_of(model, optimizer, state)


def check_skipped(state: TrainState, start: Start, *, stop_on_nonfinite: bool) -> None:
    """At an epoch's end: raise for a step with a non-finite loss (``stop_on_nonfinite``), else warn
    once how many were skipped."""
    counts = counts_on_host(state)
    if counts.skipped and stop_on_nonfinite:
        raise nonfinite_loss_stopped(start.epoch, start.step + counts.first_skipped, "jax_dp")
    if counts.skipped and is_primary():
        message = skipped_message(start.epoch, start.step + counts.first_skipped, counts.skipped)
        warnings.warn(message, RuntimeWarning, stacklevel=5)  # at the trainer's fit


def _train_steps(
    steps: Steps,
    state: TrainState,
    plan: Plan,
    mesh: Mesh,
    model: keras.Model,
    callbacks: keras.callbacks.CallbackList,
    *,
    optimizer: Optimizer,
    start: int,
    stop_on_nonfinite: bool,
    checkpoint: Callable[[TrainState, int], None] | None,
    checkpoint_due: Callable[[int], bool] | None,
    profile: FitProfile | None = None,
) -> TrainState:
    """Steps ``start..`` of one epoch; returns the state.

    With ``stop_on_nonfinite`` the loop ends at the first report or checkpoint after a
    step with a non-finite loss (the steps after it changed nothing); the caller then
    raises. ``checkpoint(state, steps_done)`` runs after the steps ``checkpoint_due`` asks for.

    When a callback acts at every batch, the model holds the current state when a batch hook
    reads it (as in ``model.fit``), what the hook changes (weights, learning rate) is read back
    before the next step (``ModelOnRequest``), and a small state's next step starts while the
    hooks run (``StepsAhead``).
    """
    reporter = BatchEndReporter(callbacks, "train", plan.steps)
    on_request = ModelOnRequest(model, optimizer, mesh, state) if reporter.every_step else None
    steps_run = stepper(steps, state, plan.padded, every_batch=on_request is not None)

    def call(state: TrainState, hook: Callable[..., None], *arguments: Any) -> TrainState:
        if on_request is None:
            hook(*arguments)
            return state
        return on_request.around(state, hook, *arguments)

    batches = enumerate(device_batches(plan, mesh, start=start), start=start)
    upcoming = next(batches, None)
    timer = None if profile is None else profile.timer
    if timer is not None:
        timer.start()
    with contextlib.nullcontext() if on_request is None else on_request.installed():
        try:
            while upcoming is not None:
                step, batch = upcoming
                state = call(state, callbacks.on_train_batch_begin, step)
                if timer is not None:
                    timer.lap("callbacks")
                done = step + 1
                reporting = reporter.due(step)
                saving = checkpoint is not None and checkpoint_due is not None and checkpoint_due(done)
                state, report = steps_run.run(state, batch, report=reporting or (saving and stop_on_nonfinite))
                if profile is not None:
                    profile.trained_on(batch)
                    profile.timer.lap(STEP)
                upcoming = next(batches, None)  # prepared while the devices run the step
                if profile is not None:  # the host's time for the next batch, then the rest of the step
                    profile.timer.lap("input")
                    jax.block_until_ready(state)
                    profile.timer.lap(STEP)
                if upcoming is not None:
                    steps_run.start(state, upcoming[1])
                skipped, logs = (0, {}) if report is None else report_on_host(report)
                if skipped and stop_on_nonfinite:
                    break
                if reporting:  # before a checkpoint writes the state back over what a hook changed
                    state = call(state, callbacks.on_train_batch_end, step, logs)
                if saving and checkpoint is not None:
                    steps_run.settle()
                    checkpoint(state, done)
                    if on_request is not None:
                        on_request.written_back(state)
                preemption.check(done, state)
                if timer is not None:  # logs, hooks and checkpoints
                    timer.lap("callbacks")
                    timer.end_step()
                if stop_requested(model, done, plan.steps):
                    break
        finally:
            steps_run.settle()
    return state


def stop_requested(model: keras.Model, done: int, steps: int | None) -> bool:
    """Whether a callback stopped training; with several processes every process must stop at the
    same step, so process 0's decision is exchanged at fixed steps."""
    if jax.process_count() == 1:
        return bool(model.stop_training)
    if done % STOP_CHECK_STEPS == 0 and (steps is None or done < steps) and agree(bool(model.stop_training)):
        model.stop_training = True
        return True
    return False


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
