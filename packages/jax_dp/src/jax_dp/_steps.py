"""The jitted stateless steps: ``(state, batch) -> (logs, state)``.

State is replicated on every device and the batch is sharded over ``"batch"``, so
XLA's SPMD partitioner turns the single-device program into a data-parallel one: it
all-reduces gradients and BatchNormalization moments over the global batch.

Exact loss without touching Keras's loss: every row gets the sample weight
``sample_weight * mask * B / real_rows``. Keras's ``sum_over_batch_size`` reduction
divides by the padded size ``B``, which leaves the mean over the real rows, exactly
what single-device Keras computes on its smaller last batch. Metrics get
``sample_weight * mask`` (a per-batch scale would tilt the epoch's running means).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import keras
from jax.sharding import Mesh

from dp_core._data import map_structure
from jax_dp._batches import Batch
from jax_dp._mesh import batch_sharded, replicated
from jax_dp._optimizers import Optimizer
from jax_dp._padding import BatchNorm, padding_aware

TrainState = tuple[list[Any], list[Any], Any, list[Any]]  # trainable, non-trainable, optimizer, metrics
Logs = dict[str, Any]


def make_train_step(
    model: keras.Model, optimizer: Optimizer, mesh: Mesh, *, batch_norm: BatchNorm
) -> Callable[[TrainState, Batch], tuple[Logs, TrainState]]:
    """One optimizer step on one global batch; the state argument is donated."""
    num_replicas = mesh.size

    def train_step(state: TrainState, batch: Batch) -> tuple[Logs, TrainState]:
        trainable, non_trainable, optimizer_state, metrics = state
        with padding_aware(
            model, batch.mask, real_rows=batch.real_rows, batch_norm=batch_norm, num_replicas=num_replicas
        ):

            def loss_fn(trainable: list[Any]) -> tuple[Any, Any]:
                loss, aux = _loss_and_updates(model, trainable, non_trainable, metrics, batch, training=True)
                return optimizer.scale_loss(loss, optimizer_state), (loss, *aux)

            (_, (loss, y_pred, new_non_trainable, new_metrics)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                trainable
            )
            trainable, optimizer_state = optimizer.apply(optimizer_state, grads, trainable)
            logs, new_metrics = _update_metrics(model, new_metrics, loss, batch, y_pred)
        return logs, (trainable, new_non_trainable, optimizer_state, new_metrics)

    everywhere = replicated(mesh)
    return jax.jit(train_step, donate_argnums=0, out_shardings=(everywhere, everywhere))


def make_test_step(
    model: keras.Model, mesh: Mesh
) -> Callable[[tuple[list[Any], list[Any]], list[Any], Batch], tuple[Logs, list[Any]]]:
    """Loss and metrics on one global batch: ``(weights, metrics, batch) -> (logs, metrics)``."""

    def test_step(weights: tuple[list[Any], list[Any]], metrics: list[Any], batch: Batch) -> tuple[Logs, list[Any]]:
        trainable, non_trainable = weights
        with padding_aware(model, batch.mask, real_rows=batch.real_rows):
            loss, (y_pred, _, metrics) = _loss_and_updates(
                model, trainable, non_trainable, metrics, batch, training=False
            )
            return _update_metrics(model, metrics, loss, batch, y_pred)

    everywhere = replicated(mesh)
    return jax.jit(test_step, donate_argnums=1, out_shardings=(everywhere, everywhere))


def make_predict_step(model: keras.Model, mesh: Mesh) -> Callable[[tuple[list[Any], list[Any]], Any], Any]:
    """The model's outputs on one global batch of inputs, sharded like the batch."""

    def predict_step(weights: tuple[list[Any], list[Any]], x: Any) -> Any:
        trainable, non_trainable = weights
        outputs, _ = cast(Any, model.stateless_call)(trainable, non_trainable, x, **_training_kwarg(model, False))
        return outputs

    return jax.jit(predict_step, out_shardings=batch_sharded(mesh))


def _training_kwarg(model: keras.Model, training: bool) -> dict[str, bool]:
    return {"training": training} if model._call_has_training_arg else {}


def _loss_and_updates(
    model: keras.Model,
    trainable: list[Any],
    non_trainable: list[Any],
    metrics: list[Any],
    batch: Batch,
    *,
    training: bool,
) -> tuple[Any, tuple[Any, list[Any], list[Any]]]:
    """Keras's ``compute_loss_and_updates`` with the exact per-row loss weights."""
    y_pred, non_trainable, losses = cast(Any, model.stateless_call)(
        trainable, non_trainable, batch.x, return_losses=True, **_training_kwarg(model, training)
    )
    if losses:  # forward-pass losses (add_loss) reach compute_loss through this override, as in Keras
        model._losses_override = losses
    try:
        loss, (_, non_trainable, metrics) = model.stateless_compute_loss(
            trainable,
            non_trainable,
            metrics,
            x=batch.x,
            y=batch.y,
            y_pred=y_pred,
            sample_weight=_row_weights(batch, scale_to_real_rows=True),
            training=training,
        )
    finally:
        model._losses_override = []
    return loss, (y_pred, non_trainable, metrics)


def _row_weights(batch: Batch, *, scale_to_real_rows: bool) -> Any:
    weights = batch.mask
    if scale_to_real_rows:
        weights = weights * (batch.mask.shape[0] / batch.real_rows)
    if batch.sample_weight is None:
        return weights

    def weigh(sample_weight: Any) -> Any:
        return sample_weight * jnp.reshape(weights, (-1,) + (1,) * (sample_weight.ndim - 1))

    return map_structure(weigh, batch.sample_weight)


def _update_metrics(
    model: keras.Model, metrics: list[Any], loss: Any, batch: Batch, y_pred: Any
) -> tuple[Logs, list[Any]]:
    """Keras's metric update, with the loss weighed by real rows and padding unweighted."""
    mapping = list(zip(model.metrics_variables, metrics, strict=True))
    with keras.StatelessScope(state_mapping=mapping) as scope:
        model._loss_tracker.update_state(loss, sample_weight=batch.real_rows)
        logs = model.compute_metrics(batch.x, batch.y, y_pred, _row_weights(batch, scale_to_real_rows=False))
    updated = [scope.get_current_value(variable) for variable in model.metrics_variables]
    return logs, [old if new is None else new for old, new in zip(metrics, updated, strict=True)]
