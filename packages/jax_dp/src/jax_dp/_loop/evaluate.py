"""The evaluate and predict loops, over Keras's own steps and over a model's own.

With ``steps_per_execution`` (``dp_core.keras.Executions``) the batch hooks and the stop flags
come at the ends of groups, as in Keras: the begin hook before a group's first step, the end hook
after its last, given the group's hook step and the logs after its last step (``predict``: the
group's outputs, concatenated). The steps of a group run one by one, each its own program.

Around a model's own ``test_step``/``predict_step`` (``_step.custom``) they do what Keras's
``JAXTrainer`` does: metrics reset before each evaluation; the state written into the model when
a callback reads it (``jax_state_sync``) and read back only if the callback changed it; batch
callbacks get each step's own logs; at the end the state, metric variables included, goes back
into the model, and the logs are the model's metric results when the step's logs name exactly
those metrics, else the last step's logs (Keras's ``_get_metrics_result_or_logs``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, final

import jax
import keras
import numpy as np

from dp_core.keras import ONE_STEP, Executions, concatenated, internals, overrides
from jax_dp._comm.hosts import agree, rows_to_host
from jax_dp._data.batches import Plan, device_batches, whole_last_batch
from jax_dp._data.groups import Group, groups_of
from jax_dp._loop.reporting import (
    BatchEndReporter,
    final_logs,
    host_logs,
    metrics_result_or_logs,
    read_ahead,
    stopped,
)
from jax_dp._mesh.layout import Placement
from jax_dp._step.custom import CustomPredictStep, CustomTestStep, EvaluationState, step_data
from jax_dp._step.metrics import metrics_on_mesh
from jax_dp._step.recipes import Recipes
from jax_dp._step.state import (
    metric_values_on_mesh,
    model_changed,
    model_values,
    weights_on_mesh,
)
from jax_dp._step.steps import PredictStep, Steps
from jax_dp._step.values import assign_all, variables_on_mesh


class Evaluator(Protocol):
    """Loss and metrics of the model's current weights over every batch of ``plan``, as
    ``model.evaluate`` logs them; batch-end ``callbacks`` as ``model.evaluate`` calls them, once per
    group of ``executions``."""

    def __call__(
        self, plan: Plan, callbacks: keras.callbacks.CallbackList | None, executions: Executions = ONE_STEP
    ) -> dict[str, Any]: ...


def evaluator(model: keras.Model, recipes: Recipes) -> Evaluator:
    """How ``evaluate`` and validation run: with the model's own ``test_step`` or Keras's, on the
    placement of ``recipes``, which give the steps."""
    placement = recipes.placement
    if overrides(model, "test_step"):
        test_step = recipes.custom_test_step(model)

        def evaluate_custom(
            plan: Plan, callbacks: keras.callbacks.CallbackList | None, executions: Executions = ONE_STEP
        ) -> dict[str, Any]:
            return custom_evaluate_loop(model, test_step, plan, placement, callbacks, executions)

        return evaluate_custom
    steps = recipes.steps(model)

    def evaluate(
        plan: Plan, callbacks: keras.callbacks.CallbackList | None, executions: Executions = ONE_STEP
    ) -> dict[str, Any]:
        return evaluate_loop(model, steps, plan, placement, callbacks, executions)

    return evaluate


def evaluate_loop(
    model: keras.Model,
    steps: Steps,
    plan: Plan,
    placement: Placement,
    callbacks: keras.callbacks.CallbackList | None = None,
    executions: Executions = ONE_STEP,
) -> dict[str, Any]:
    """Loss and metrics of the model's current weights over every sample of the plan (running
    means over real rows), the metric states left in the model as ``model.evaluate`` leaves them;
    batch-end ``callbacks`` as ``model.evaluate`` calls them, once per group of ``executions``."""
    mesh = placement.mesh
    weights = weights_on_mesh(model, placement)
    metrics = metrics_on_mesh(model, mesh)
    reporter = None if callbacks is None else BatchEndReporter(callbacks, "test", plan.steps)
    whole_last = whole_last_batch(model, plan, training=False)
    batches = device_batches(plan, mesh, whole_last=whole_last, prefetch=read_ahead(reporter))
    for group in groups_of(batches, executions, plan.steps):
        if reporter is not None and callbacks is not None and reporter.every_step:
            callbacks.on_test_batch_begin(group.first)
        for batch in group.batches:
            non_trainable, metrics = steps.test(weights, metrics, batch, plan.padded)
            weights = weights._replace(non_trainable=non_trainable)  # a seed generator advances, as in model.evaluate
        reported = reporter is not None and callbacks is not None and reporter.due(group.last, first=group.first)
        if reported and callbacks is not None:
            callbacks.on_test_batch_end(executions.hook_step(group.last), host_logs(steps.results(metrics)))
        if stopped(model, "stop_evaluating", reported=reported):
            break
    write_non_trainable(model, weights.non_trainable)
    return final_logs(model, steps, metrics, mesh)


def predict_loop(
    predict_step: PredictStep,
    model: keras.Model,
    plan: Plan,
    placement: Placement,
    callbacks: keras.callbacks.CallbackList,
    executions: Executions = ONE_STEP,
) -> Any:
    """The model's outputs for every sample, in the plan's (input) order, padding dropped; the
    non-trainable values the calls leave written back, as ``model.predict`` does."""
    build_for_predict(model, plan)
    weights = weights_on_mesh(model, placement)
    reporter = BatchEndReporter(callbacks, "predict", plan.steps)
    outputs = []
    batches = device_batches(plan, placement.mesh, prefetch=read_ahead(reporter))
    for group in groups_of(batches, executions, plan.steps):
        if reporter.every_step:
            callbacks.on_predict_batch_begin(group.first)
        for batch in group.batches:
            batch_outputs, non_trainable = predict_step(weights, batch.x)
            weights = weights._replace(non_trainable=non_trainable)  # a seed generator advances, as in model.predict
            outputs.append(batch_outputs)
        if reported := reporter.due(group.last, first=group.first):
            real = [plan.real_rows(step) for step in range(group.first, group.last + 1)]
            _predicted(callbacks, executions, group, outputs[-group.size :], real)
        if stopped(model, "stop_predicting", reported=reported):
            break
    write_non_trainable(model, weights.non_trainable)
    # Pulled at the end, not per batch, so the devices never wait for the host.
    host = [_real_rows_to_host(output, plan.real_rows(step)) for step, output in enumerate(outputs)]
    return jax.tree.map(lambda *parts: np.concatenate(parts), *host)


def _predicted(
    callbacks: keras.callbacks.CallbackList,
    executions: Executions,
    group: Group[Any],
    outputs: list[Any],
    real_rows: list[int] | None = None,
) -> None:
    """The predict end hook after ``group``: its steps' ``outputs`` as ``model.predict`` hands them
    over, without padding (``real_rows`` of each step; None: none padded), concatenated."""
    if real_rows is not None:
        outputs = [
            jax.tree.map(lambda leaf, real=real: leaf[:real], output)
            for output, real in zip(outputs, real_rows, strict=True)
        ]
    callbacks.on_predict_batch_end(executions.hook_step(group.last), {"outputs": concatenated(outputs)})


def build_for_predict(model: keras.Model, plan: Plan) -> None:
    """A model whose layers are not all built (a subclassed model after ``build(shape)``) is
    called once on the first rows, as ``model.predict`` does, so no variable is created inside
    the jitted step."""
    if not all(layer.built for layer in internals.flatten_layers(model, include_self=True)):
        x, _, _ = plan.inputs.first_rows()
        with keras.StatelessScope():  # creates the variables, changes no state
            model(x)


def write_non_trainable(model: keras.Model, values: list[Any]) -> None:
    """The non-trainable values an evaluation or prediction ends with into the model, as Keras's
    ``jax_state_sync`` writes them: a seed generator drawn from in ``call`` goes on from there."""
    assign_all(model.non_trainable_variables, values)


def _real_rows_to_host(output: Any, real_rows: int) -> Any:
    return jax.tree.map(lambda leaf: rows_to_host(leaf)[:real_rows], output)


def custom_evaluate_loop(
    model: keras.Model,
    test_step: CustomTestStep,
    plan: Plan,
    placement: Placement,
    callbacks: keras.callbacks.CallbackList | None = None,
    executions: Executions = ONE_STEP,
) -> dict[str, Any]:
    """The model's own ``test_step`` over every batch of ``plan``, as ``model.evaluate`` runs it:
    metrics reset first, the state (metric variables included) written back at the end; the batch
    hooks once per group of ``executions``."""
    state = EvaluationState(*weights_on_mesh(model, placement), metric_values_on_mesh(model, placement.mesh))
    reporter = None if callbacks is None else BatchEndReporter(callbacks, "test", plan.steps)
    last_logs = None
    with _EvaluationOnRequest(model, placement) as on_request:
        data = step_data(plan, placement.mesh, prefetch=read_ahead(reporter))
        for group in groups_of(data, executions, plan.steps):
            if reporter is not None and callbacks is not None and reporter.every_step:
                state = on_request.around(state, callbacks.on_test_batch_begin, group.first)
            for batch_data in group.batches:
                state, last_logs = test_step(state, batch_data)
            reported = reporter is not None and callbacks is not None and reporter.due(group.last, first=group.first)
            if reported and callbacks is not None:
                hook_step = executions.hook_step(group.last)
                state = on_request.around(state, callbacks.on_test_batch_end, hook_step, host_logs(last_logs))
            if stopped(model, "stop_evaluating", reported=reported):
                break
        _write_evaluation(model, state)
    return metrics_result_or_logs(model, last_logs)


@final
class _EvaluationOnRequest:
    """During an evaluation, Keras's ``state_sync`` (a callback reading ``self.model``) writes
    the current state into the model, and a state the callback changed is read back before the
    next step: ``ModelOnRequest`` for an evaluation's state."""

    def __init__(self, model: keras.Model, placement: Placement) -> None:
        self.model = model
        self.placement = placement
        self._offered: EvaluationState | None = None
        self._written: list[Any] | None = None

    def __enter__(self) -> _EvaluationOnRequest:
        self._restore = internals.override(self.model, internals.state_sync_name(self.model), self._sync)
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
            *weights_on_mesh(self.model, self.placement),
            variables_on_mesh(self.model.metrics_variables, self.placement.mesh),
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
        assign_all(variables, values)


def custom_predict_loop(
    predict_step: CustomPredictStep,
    model: keras.Model,
    plan: Plan,
    placement: Placement,
    callbacks: keras.callbacks.CallbackList,
    executions: Executions = ONE_STEP,
) -> Any:
    """The model's own ``predict_step`` on every batch, outputs concatenated in input order as
    ``model.predict`` does; the non-trainable values it returns end in the model, as in Keras."""
    build_for_predict(model, plan)
    weights = weights_on_mesh(model, placement)
    reporter = BatchEndReporter(callbacks, "predict", plan.steps)
    outputs = []
    for group in groups_of(step_data(plan, placement.mesh, prefetch=read_ahead(reporter)), executions, plan.steps):
        if reporter.every_step:
            callbacks.on_predict_batch_begin(group.first)
        for data in group.batches:
            weights, batch_outputs = predict_step(weights, data)
            outputs.append(batch_outputs)
        if reported := reporter.due(group.last, first=group.first):
            _predicted(callbacks, executions, group, outputs[-group.size :])
        if stopped(model, "stop_predicting", reported=reported):
            break
    write_non_trainable(model, weights.non_trainable)
    # Pulled at the end, not per batch, so the devices never wait for the host.
    host = [jax.tree.map(rows_to_host, batch_outputs) for batch_outputs in outputs]
    return jax.tree.map(lambda *parts: np.concatenate(parts), *host)
