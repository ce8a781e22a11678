"""The jitted stateless steps: ``(state, batch) -> state``; ``Steps``, those of one fit; and
``Report``, a step's logs for the host in one array.

Model and optimizer state are replicated on every device and the batch is sharded over
``"batch"``, so XLA's SPMD partitioner turns the single-device program into a
data-parallel one: it all-reduces gradients and BatchNormalization moments over the
global batch. Metric states stay per replica (``_step.metrics``); logs are read apart.

Exact loss: when the epoch's last batch is padded, each compiled loss's values carry the
padding as a Keras mask (``_step.padding``), so Keras's own reduction divides by the real rows'
values (or valid mask positions), exactly what single-device Keras computes on its smaller
last batch; the user's sample weights pass through unchanged. A model that overrides
``compute_loss`` gets ``sample_weight * mask * B / real_rows`` instead, which is exact for
a per-row loss with ``sum_over_batch_size``. Metrics get ``sample_weight * mask`` (a
per-batch scale would tilt the epoch's running means).

A model that computes a term over the batch (BatchNormalization, its own ``compute_loss``, a
row-dependent ``add_loss``) gets its short last batch whole instead (``_data.batches.WholeBatch``):
Keras's own step on every device, as ``model.fit`` runs it; the step compiles once more, for it.

``padded`` is static: a step compiles once for padded and once for unpadded epochs. The
trainer keeps the steps between calls (``_step.compile_cache``), so each holds its model weakly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, cast, final

import jax
import jax.numpy as jnp
import keras
from jax.sharding import Mesh

from dp_core import BatchNormMode
from dp_core.keras import internals, python_logs
from jax_dp._comm.hosts import replicated_to_host
from jax_dp._data.batches import Batch, WholeBatch, row_weights
from jax_dp._mesh.layout import Placement, gradient_shardings, weight_shardings
from jax_dp._mesh.mesh import batch_sharded, num_replicas_of, replicated
from jax_dp._step.accumulation import accumulated_shardings, accumulated_update, accumulates
from jax_dp._step.compile_cache import held_weakly
from jax_dp._step.metrics import Logs, make_metric_update, results_of, whole_batch_metric_update, zero_states
from jax_dp._step.optimizers import Optimizer
from jax_dp._step.padding import computes_own_loss, padding_aware
from jax_dp._step.state import TrainState, Weights, step_taken


class Report(NamedTuple):
    """A step's logs for the host in one array to read: ``values`` holds the count of skipped
    steps, then every log value as float32 (exact for counts below 2**24); ``logs`` (never
    read) gives their names, shapes and dtypes."""

    logs: Logs
    values: jax.Array


def report_of(logs: Logs, skipped: Any) -> Report:
    """The report of ``logs`` and the skipped-step count, inside a jitted step."""
    parts = [jnp.reshape(skipped, (1,)), *(jnp.ravel(value) for value in jax.tree.leaves(logs))]
    return Report(logs, jnp.concatenate([part.astype(jnp.float32) for part in parts]))


def report_on_host(report: Report) -> tuple[int, dict[str, Any]]:
    """The skipped-step count and the logs as ``model.fit`` hands them to callbacks (waits for the step)."""
    values = replicated_to_host(report.values)
    leaves, structure = jax.tree.flatten(report.logs)
    parts, at = [], 1
    for leaf in leaves:
        parts.append(values[at : at + leaf.size].reshape(leaf.shape).astype(leaf.dtype))
        at += leaf.size
    return int(values[0]), python_logs(jax.tree.unflatten(structure, parts))


TrainStep = Callable[[TrainState, Batch, bool], TrainState]
ReportingStep = Callable[[TrainState, Any, bool], tuple[TrainState, Report]]
TestStep = Callable[[Weights, list[Any], Batch, bool], tuple[list[Any], list[Any]]]
PredictStep = Callable[[Weights, Any], tuple[Any, list[Any]]]


@final
class Steps:
    """The jitted steps of one call, each taken from the trainer's compile cache (``fetch(name)``)
    when first used: a call replaces only the cached steps it runs (a fit with a batch callback
    trains with ``train_reporting``, one without with ``train``)."""

    def __init__(self, fetch: Callable[[str], Any]) -> None:
        self._fetch = fetch

    @functools.cached_property
    def train(self) -> TrainStep:
        return self._fetch("train")

    @functools.cached_property
    def train_reporting(self) -> ReportingStep:
        """Every step of a fit with a callback that reads every batch's logs: one program a step."""
        return self._fetch("train_reporting")

    @functools.cached_property
    def train_scanned(self) -> Callable[[TrainState, Batch, bool], tuple[TrainState, Report]]:
        """A group of ``steps_per_execution`` steps in one program, with its report (``_step.scan``)."""
        return self._fetch("train_scanned")

    @functools.cached_property
    def report(self) -> Callable[[list[jax.Array], jax.Array], Report]:
        """``(metric stacks, skipped count) -> report``."""
        return self._fetch("report")

    @functools.cached_property
    def test(self) -> TestStep:
        """``(weights, metric stacks, batch, padded) -> (non-trainable values, metric stacks)``."""
        return self._fetch("test")

    @functools.cached_property
    def results(self) -> Callable[[list[jax.Array]], Logs]:
        return self._fetch("results")


def make_train_step(
    model: keras.Model,
    optimizer: Optimizer,
    placement: Placement,
    *,
    batch_norm: BatchNormMode,
    skip_nonfinite: bool,
    apply_nonfinite: bool = False,
) -> TrainStep:
    """One optimizer step on one global batch: ``(state, batch, padded) -> state``; the state
    argument is donated; ``padded`` (static) says whether any batch of the epoch is padded."""
    train_step = train_step_of(
        model,
        optimizer,
        placement,
        batch_norm=batch_norm,
        skip_nonfinite=skip_nonfinite,
        apply_nonfinite=apply_nonfinite,
    )
    return jax.jit(
        train_step, donate_argnums=0, static_argnums=2, out_shardings=state_shardings(model, optimizer, placement)
    )


def make_reporting_train_step(
    model: keras.Model,
    optimizer: Optimizer,
    placement: Placement,
    *,
    batch_norm: BatchNormMode,
    skip_nonfinite: bool,
    apply_nonfinite: bool = False,
) -> ReportingStep:
    """``make_train_step``'s step (its state donated) with its report: the logs and skipped count,
    replicated. One program a step: on CPU, where the devices share the host's cores, each
    program launched costs a short step more than the work it does."""
    train_step = train_step_of(
        model,
        optimizer,
        placement,
        batch_norm=batch_norm,
        skip_nonfinite=skip_nonfinite,
        apply_nonfinite=apply_nonfinite,
    )
    model_now = held_weakly(model)

    def reporting_train_step(state: TrainState, batch: Batch, padded: bool) -> tuple[TrainState, Report]:
        state = train_step(state, batch, padded)
        return state, report_of(results_of(model_now(), state.metrics), state.counts.skipped)

    shardings = (state_shardings(model, optimizer, placement), replicated(placement.mesh))
    return jax.jit(reporting_train_step, donate_argnums=0, static_argnums=2, out_shardings=shardings)


def make_report(model: keras.Model, mesh: Mesh) -> Callable[[list[jax.Array], jax.Array], Report]:
    """Jitted: the report of a state's metric stacks and skipped-step count (one array to read)."""
    model_now = held_weakly(model)

    def report(stacks: list[Any], skipped: Any) -> Report:
        return report_of(results_of(model_now(), stacks), skipped)

    return jax.jit(report, out_shardings=replicated(mesh))


def state_shardings(model: keras.Model, optimizer: Optimizer, placement: Placement) -> Any:
    # A sharding in place of a field (a pytree prefix) applies to every array in it. Weights and
    # optimizer state lie as the call's placement says (replicated without a layout: ``_mesh.layout``).
    everywhere: Any = replicated(placement.mesh)
    per_replica: Any = batch_sharded(placement.mesh)
    weights = weight_shardings(model, placement)
    return TrainState(
        trainable=weights.trainable,
        non_trainable=weights.non_trainable,
        optimizer=optimizer.state_shardings(model, placement),
        metrics=per_replica,
        counts=everywhere,
        accumulated=accumulated_shardings(model, optimizer, placement),
    )


def train_step_of(
    model: keras.Model,
    optimizer: Optimizer,
    placement: Placement,
    *,
    batch_norm: BatchNormMode,
    skip_nonfinite: bool,
    apply_nonfinite: bool = False,
) -> TrainStep:
    """The train step to jit.

    A step whose loss is not finite changes nothing but the counts. Unless
    ``skip_nonfinite``, every later step does the same, so the state stays that of the
    last good step until the host sees the count and stops. With ``apply_nonfinite`` (a
    ``TerminateOnNaN`` among the callbacks) every step is applied, as in ``model.fit``.

    The step keeps ``optimizer`` for its pure ``scale_loss``/``apply``: a later fit reuses it
    only with an optimizer traced from the same things (``Optimizer.traced_from``).
    """
    mesh = placement.mesh
    num_replicas = num_replicas_of(mesh)
    model_now = held_weakly(model)

    def train_step(state: TrainState, batch: Batch, padded: bool) -> TrainState:
        model = model_now()
        if isinstance(batch, WholeBatch):  # Keras's own step: no padding, no split; its metrics count once, in slot 0
            forward, updated = _gradient_update(model, optimizer, placement, state, batch)
            update_metrics = functools.partial(whole_batch_metric_update, model)
        else:
            with padding_aware(
                model,
                batch.mask,
                real_rows=batch.real_rows,
                padded=padded,
                batch_norm=batch_norm,
                num_replicas=num_replicas,
            ):
                forward, updated = gradient_update(model, state, batch)
            update_metrics = make_metric_update(model, mesh)
        (loss, y_pred, non_trainable, increments), (trainable, optimizer_state, accumulated) = forward, updated
        metrics = update_metrics(state.metrics, increments, loss, batch, y_pred)
        new = TrainState(trainable, non_trainable, optimizer_state, metrics, state.counts, accumulated)
        return step_taken(applied(loss, state), new, state, mesh)

    def gradient_update(model: keras.Model, state: TrainState, batch: Batch) -> Any:
        if accumulates(optimizer):  # gradients summed per replica, all-reduced once per window
            per_replica = batch_norm == "global"
            return accumulated_update(
                model, optimizer, placement, state, batch, loss_and_updates=_loss_and_updates, per_replica=per_replica
            )
        return _gradient_update(model, optimizer, placement, state, batch)

    def applied(loss: Any, state: TrainState) -> Any:
        """Whether the step's update is kept: always with ``apply_nonfinite``, else a finite loss (and,
        unless ``skip_nonfinite``, no step skipped before it)."""
        if apply_nonfinite:
            return jnp.ones((), dtype=bool)
        return jnp.isfinite(loss) if skip_nonfinite else jnp.isfinite(loss) & (state.counts.skipped == 0)

    return train_step


def _gradient_update(
    model: keras.Model, optimizer: Optimizer, placement: Placement, state: TrainState, batch: Batch
) -> tuple[tuple[Any, Any, list[Any], list[Any]], tuple[list[Any], Any, Any]]:
    """One gradient step on ``batch`` within a train step: ``(loss, y_pred, non-trainable weights,
    metric increments)`` of the forward pass, then the trainable weights and optimizer state after
    ``optimizer.apply``, with the state's gradient sums unchanged (``accumulated_update``'s shape);
    the loss is differentiated as ``optimizer.scale_loss`` scales it. With ``shard="gradients"``/
    ``"full"`` the gradients lie like the optimizer's slots before the update
    (``_mesh.layout.gradient_shardings``): XLA reduce-scatters them, each device summing its part."""

    def loss_fn(trainable: list[Any]) -> tuple[Any, Any]:
        loss, aux = _loss_and_updates(model, trainable, state.non_trainable, batch, training=True)
        return optimizer.scale_loss(loss, state.optimizer), (loss, *aux)

    (_, forward), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.trainable)
    trainable, optimizer_state = optimizer.apply(
        state.optimizer, placed_gradients(model, placement, grads), state.trainable
    )
    return forward, (trainable, optimizer_state, state.accumulated)


def placed_gradients(model: keras.Model, placement: Placement, grads: list[Any]) -> list[Any]:
    """Inside a jitted step: ``grads`` constrained to ``gradient_shardings`` (unchanged when None)."""
    shardings = gradient_shardings(model, placement)
    if shardings is None:
        return grads
    return [jax.lax.with_sharding_constraint(g, s) for g, s in zip(grads, shardings, strict=True)]


def make_test_step(model: keras.Model, placement: Placement) -> TestStep:
    """Loss and metrics on one global batch: ``(weights, metric stacks, batch, padded) -> (non-trainable
    values, metric stacks)``; the non-trainable values as the forward pass leaves them (a seed
    generator advanced), which Keras's ``evaluate`` keeps from step to step and writes back."""
    mesh = placement.mesh
    model_now = held_weakly(model)

    def test_step(weights: Weights, metrics: list[Any], batch: Batch, padded: bool) -> tuple[list[Any], list[Any]]:
        model = model_now()
        if isinstance(batch, WholeBatch):
            loss, (y_pred, non_trainable, increments) = _loss_and_updates(
                model, weights.trainable, weights.non_trainable, batch, training=False
            )
            return non_trainable, whole_batch_metric_update(model, metrics, increments, loss, batch, y_pred)
        with padding_aware(model, batch.mask, real_rows=batch.real_rows, padded=padded):
            loss, (y_pred, non_trainable, increments) = _loss_and_updates(
                model, weights.trainable, weights.non_trainable, batch, training=False
            )
        return non_trainable, make_metric_update(model, mesh)(metrics, increments, loss, batch, y_pred)

    shardings = (weight_shardings(model, placement).non_trainable, batch_sharded(mesh))
    return jax.jit(test_step, donate_argnums=1, static_argnums=3, out_shardings=shardings)


def make_predict_step(model: keras.Model, placement: Placement) -> PredictStep:
    """The model's outputs on one global batch of inputs, sharded like the batch, and the
    non-trainable values the call leaves (a seed generator advanced), as Keras's ``predict``
    keeps them from step to step: ``(weights, x) -> (outputs, non-trainable values)``."""
    model_now = held_weakly(model)

    def predict_step(weights: Weights, x: Any) -> tuple[Any, list[Any]]:
        model = model_now()
        outputs, non_trainable = cast(Any, model.stateless_call)(
            weights.trainable, weights.non_trainable, x, **internals.training_kwargs(model, False)
        )
        return outputs, non_trainable

    shardings = (batch_sharded(placement.mesh), weight_shardings(model, placement).non_trainable)
    return jax.jit(predict_step, out_shardings=shardings)


def _loss_and_updates(
    model: keras.Model,
    trainable: list[Any],
    non_trainable: list[Any],
    batch: Batch,
    *,
    training: bool,
    call: Callable[[list[Any], list[Any], Any], tuple[Any, list[Any], list[Any]]] | None = None,
) -> tuple[Any, tuple[Any, list[Any], list[Any]]]:
    """Keras's ``compute_loss_and_updates`` on the padded batch (see the module's docstring).

    The metric states returned are this batch's increments (per-output loss trackers). ``call``
    replaces the model's ``stateless_call`` (``_step.accumulation``'s per-replica forward).
    """
    if call is not None:
        y_pred, non_trainable, losses = call(trainable, non_trainable, batch.x)
    else:
        y_pred, non_trainable, losses = cast(Any, model.stateless_call)(
            trainable, non_trainable, batch.x, return_losses=True, **internals.training_kwargs(model, training)
        )
    with internals.forward_losses(model, losses):
        loss, (_, non_trainable, metrics) = model.stateless_compute_loss(
            trainable,
            non_trainable,
            zero_states(model),
            x=batch.x,
            y=batch.y,
            y_pred=y_pred,
            sample_weight=row_weights(batch, scale_to_real_rows=True)
            if computes_own_loss(model) and not isinstance(batch, WholeBatch)
            else batch.sample_weight,
            training=training,
        )
    return loss, (y_pred, non_trainable, metrics)
