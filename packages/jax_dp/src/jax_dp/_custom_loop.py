"""The host-side loops around a model's own steps (``_custom_steps``), as Keras's ``JAXTrainer``
runs them.

What Keras does around an override, and so these loops: metrics reset before each epoch (and each
evaluation); the state read from the model when an epoch starts and after a callback read it
(``jax_state_sync``: ``ModelOnRequest`` here, which writes it only when a callback asks and reads
it back only if the callback changed it); batch callbacks get each step's own logs; at the end
the state, metric variables included, goes back into the model, and the epoch's logs are the
model's metric results when the step's logs name exactly those metrics, else the last step's
logs (Keras's ``_get_metrics_result_or_logs``). The epochs, validation, History, checkpoints and
stop decisions are ``_loop``'s, shared with Keras's own steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, final

import jax
import keras
import numpy as np
from jax.sharding import Mesh

from dp_core.keras import CheckpointWriter, Start, internals, python_logs
from jax_dp import _preemption as preemption
from jax_dp._batches import Plan
from jax_dp._checkpoints import save
from jax_dp._custom_steps import (
    CustomPredictStep,
    CustomTestStep,
    CustomTrainStep,
    EvaluationState,
    step_data,
)
from jax_dp._distributed import agree, replicated_to_host, rows_to_host
from jax_dp._loop import BatchEndReporter, EpochTrainer, build_for_predict, check_skipped, host_logs, stop_requested
from jax_dp._optimizers import Optimizer
from jax_dp._state import (
    ModelOnRequest,
    TrainState,
    metric_values_on_mesh,
    model_changed,
    model_values,
    train_state_on_mesh,
    variables_on_mesh,
    weights_on_mesh,
    write_back,
)
from jax_dp._steps import report_on_host


def custom_epochs(
    model: keras.Model,
    *,
    train_step: CustomTrainStep,
    optimizer: Optimizer,
    mesh: Mesh,
    checkpoints: CheckpointWriter | None,
    stop_on_nonfinite: bool,
) -> EpochTrainer:
    """Epochs of the model's own ``train_step``."""

    def train_epoch(
        plan: Plan, callbacks: keras.callbacks.CallbackList, *, start: Start, optimizer_state: Any | None
    ) -> tuple[dict[str, Any], None]:
        del optimizer_state  # a Keras optimizer's: read from the model every epoch
        return _train_epoch(
            model,
            plan,
            callbacks,
            start=start,
            train_step=train_step,
            optimizer=optimizer,
            mesh=mesh,
            checkpoints=checkpoints,
            stop_on_nonfinite=stop_on_nonfinite,
        ), None

    return train_epoch


def _train_epoch(
    model: keras.Model,
    plan: Plan,
    callbacks: keras.callbacks.CallbackList,
    *,
    start: Start,
    train_step: CustomTrainStep,
    optimizer: Optimizer,
    mesh: Mesh,
    checkpoints: CheckpointWriter | None,
    stop_on_nonfinite: bool,
) -> dict[str, Any]:
    """One epoch from ``start.step``; the model holds its state afterwards. Returns its logs."""
    state = train_state_on_mesh(
        model,
        optimizer,
        mesh,
        previous_optimizer_state=None,
        metric_sums=start.metric_variables if start.step else None,
        whole_metrics=True,
    )

    def checkpoint(state: TrainState, steps_done: int) -> None:
        assert checkpoints is not None
        write_back(model, optimizer, state, metrics=True)
        metric_variables = list(replicated_to_host(state.metrics))
        save(checkpoints, model, optimizer, None, epoch=start.epoch, step=steps_done, metric_variables=metric_variables)

    try:
        state, last_logs = _train_steps(
            train_step,
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
        )
    except preemption.StoppedAt as stop:
        raise preemption.preempted(
            stop,
            epoch=start.epoch,
            write_back=lambda state: write_back(model, optimizer, state, metrics=True),
            checkpoint=None if checkpoints is None else checkpoint,
            directory=None if checkpoints is None else checkpoints.directory,
        ) from None
    write_back(model, optimizer, state, metrics=True)
    check_skipped(state, start, stop_on_nonfinite=stop_on_nonfinite)
    return metrics_result_or_logs(model, last_logs)


def _train_steps(
    train_step: CustomTrainStep,
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
) -> tuple[TrainState, Any]:
    """Steps ``start..`` of one epoch, as ``_loop._train_steps`` runs Keras's (one at a time);
    returns the state and the last step's logs (on the devices; None when no step ran)."""
    reporter = BatchEndReporter(callbacks, "train", plan.steps)
    on_request = ModelOnRequest(model, optimizer, mesh, state, metrics=True) if reporter.every_step else None

    def call(state: TrainState, hook: Callable[..., None], *arguments: Any) -> TrainState:
        if on_request is None:
            hook(*arguments)
            return state
        return on_request.around(state, hook, *arguments)

    last_logs = None
    with contextlib.nullcontext() if on_request is None else on_request.installed():
        for step, data in enumerate(step_data(plan, mesh, start=start), start=start):
            state = call(state, callbacks.on_train_batch_begin, step)
            state, report = train_step(state, data)
            last_logs = report.logs
            done = step + 1
            reporting = reporter.due(step)
            saving = checkpoint is not None and checkpoint_due is not None and checkpoint_due(done)
            logs: dict[str, Any] = {}
            if reporting or (saving and stop_on_nonfinite):
                skipped, logs = report_on_host(report)
                if skipped and stop_on_nonfinite:
                    break
            if reporting:  # before a checkpoint writes the state back over what a hook changed
                state = call(state, callbacks.on_train_batch_end, step, logs)
            if saving and checkpoint is not None:
                checkpoint(state, done)
                if on_request is not None:
                    on_request.written_back(state)
            preemption.check(done, state)
            if stop_requested(model, done, plan.steps):
                break
    return state, last_logs


def metrics_result_or_logs(model: keras.Model, last_logs: Any) -> dict[str, Any]:
    """The logs ``model.fit`` and ``model.evaluate`` end with (Keras's ``_get_metrics_result_or_logs``):
    the model's metric results when the last step's logs name exactly them, else those logs."""
    results = model.get_metrics_result()
    if isinstance(last_logs, dict) and set(last_logs) == set(results):
        return python_logs(results)
    return host_logs(last_logs)


def custom_evaluate_loop(
    model: keras.Model,
    test_step: CustomTestStep,
    plan: Plan,
    mesh: Mesh,
    callbacks: keras.callbacks.CallbackList | None = None,
) -> dict[str, Any]:
    """The model's own ``test_step`` over every batch of ``plan``, as ``model.evaluate`` runs it:
    metrics reset first, the state (metric variables included) written back at the end."""
    state = EvaluationState(*weights_on_mesh(model, mesh), metric_values_on_mesh(model, mesh))
    reporter = None if callbacks is None else BatchEndReporter(callbacks, "test", plan.steps)
    last_logs = None
    with _EvaluationOnRequest(model, mesh) as on_request:
        for step, data in enumerate(step_data(plan, mesh)):
            if reporter is not None and callbacks is not None and reporter.every_step:
                state = on_request.around(state, callbacks.on_test_batch_begin, step)
            state, last_logs = test_step(state, data)
            if reporter is not None and callbacks is not None and reporter.due(step):
                state = on_request.around(state, callbacks.on_test_batch_end, step, host_logs(last_logs))
        _write_evaluation(model, state)
    return metrics_result_or_logs(model, last_logs)


@final
class _EvaluationOnRequest:
    """During an evaluation, Keras's ``jax_state_sync`` (a callback reading ``self.model``) writes
    the current state into the model, and a state the callback changed is read back before the
    next step: ``ModelOnRequest`` for an evaluation's state."""

    def __init__(self, model: keras.Model, mesh: Mesh) -> None:
        self.model = model
        self.mesh = mesh
        self._offered: EvaluationState | None = None
        self._written: list[Any] | None = None

    def __enter__(self) -> _EvaluationOnRequest:
        self._restore = internals.override(self.model, "jax_state_sync", self._sync)
        return self

    def __exit__(self, *exception: object) -> None:
        self._restore()

    def around(self, state: EvaluationState, hook: Callable[..., None], *arguments: Any) -> EvaluationState:
        """Runs ``hook(*arguments)`` with ``state`` as what the model holds when read; returns
        ``state``, or the model's values where a callback changed them (process 0's decision;
        every process calls this at the same steps)."""
        self._offered, self._written = state, None
        try:
            hook(*arguments)
        finally:
            self._offered = None
        changed = self._written is not None and model_changed(self.model, self._written, metrics=True)
        if jax.process_count() > 1:
            changed = agree(changed)
        if not changed:
            return state
        return EvaluationState(
            *weights_on_mesh(self.model, self.mesh), variables_on_mesh(self.model.metrics_variables, self.mesh)
        )

    def _sync(self) -> None:
        if self._offered is not None and self._written is None:
            _write_evaluation(self.model, self._offered)
            self._written = model_values(self.model, metrics=True)


def _write_evaluation(model: keras.Model, state: EvaluationState) -> None:
    """The state into the model as host copies, as Keras's ``jax_state_sync`` after ``evaluate``."""
    pairs = (
        (model.trainable_variables, state.trainable),
        (model.non_trainable_variables, state.non_trainable),
        (model.metrics_variables, state.metrics),
    )
    for variables, values in pairs:
        for variable, value in zip(variables, replicated_to_host(values), strict=True):
            variable.assign(value)


def custom_predict_loop(
    predict_step: CustomPredictStep,
    model: keras.Model,
    plan: Plan,
    mesh: Mesh,
    callbacks: keras.callbacks.CallbackList,
) -> Any:
    """The model's own ``predict_step`` on every batch, outputs concatenated in input order as
    ``model.predict`` does; the non-trainable values it returns end in the model, as in Keras."""
    build_for_predict(model, plan)
    weights = weights_on_mesh(model, mesh)
    reporter = BatchEndReporter(callbacks, "predict", plan.steps)
    outputs = []
    for step, data in enumerate(step_data(plan, mesh)):
        weights, batch_outputs = predict_step(weights, data)
        outputs.append(batch_outputs)
        if reporter.due(step):
            callbacks.on_predict_batch_end(step, {"outputs": batch_outputs})
    for variable, value in zip(model.non_trainable_variables, replicated_to_host(weights.non_trainable), strict=True):
        variable.assign(value)
    # Pulled at the end, not per batch, so the devices never wait for the host.
    host = [jax.tree.map(rows_to_host, batch_outputs) for batch_outputs in outputs]
    return jax.tree.map(lambda *parts: np.concatenate(parts), *host)
