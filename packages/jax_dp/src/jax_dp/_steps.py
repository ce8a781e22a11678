"""The jitted stateless steps: ``(state, batch) -> state``.

Model and optimizer state are replicated on every device and the batch is sharded over
``"batch"``, so XLA's SPMD partitioner turns the single-device program into a
data-parallel one: it all-reduces gradients and BatchNormalization moments over the
global batch. Metric states stay per replica (``_metrics``); logs are read apart.

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
import numpy as np
from jax.sharding import Mesh

from jax_dp._batches import Batch, row_weights
from jax_dp._mesh import batch_sharded, put_replicated, replicated
from jax_dp._metrics import make_metric_update, zero_states
from jax_dp._optimizers import Optimizer
from jax_dp._padding import BatchNorm, padding_aware

TrainState = tuple[list[Any], list[Any], Any, list[Any], Any]
"""Trainable, non-trainable, optimizer state, per-replica metric stacks, and the step counts
``[steps, skipped, first_skipped]`` (``first_skipped`` is -1 until a step is skipped)."""


def initial_counts(mesh: Mesh) -> jax.Array:
    return put_replicated(np.array([0, 0, -1], np.int32), mesh)


def make_train_step(
    model: keras.Model, optimizer: Optimizer, mesh: Mesh, *, batch_norm: BatchNorm, skip_nonfinite: bool
) -> Callable[[TrainState, Batch], TrainState]:
    """One optimizer step on one global batch; the state argument is donated.

    A step whose loss is not finite changes nothing but the counts. Unless
    ``skip_nonfinite``, every later step does the same, so the state stays that of the
    last good step until the host sees the count and stops.
    """
    num_replicas = mesh.size
    update_metrics = make_metric_update(model, mesh)

    def train_step(state: TrainState, batch: Batch) -> TrainState:
        trainable, non_trainable, optimizer_state, metrics, counts = state
        with padding_aware(
            model, batch.mask, real_rows=batch.real_rows, batch_norm=batch_norm, num_replicas=num_replicas
        ):

            def loss_fn(trainable: list[Any]) -> tuple[Any, Any]:
                loss, aux = _loss_and_updates(model, trainable, non_trainable, batch, training=True)
                return optimizer.scale_loss(loss, optimizer_state), (loss, *aux)

            (_, (loss, y_pred, new_non_trainable, increments)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                trainable
            )
            new_trainable, new_optimizer_state = optimizer.apply(optimizer_state, grads, trainable)
        new_metrics = update_metrics(metrics, increments, loss, batch, y_pred)
        steps, skipped, first_skipped = counts[0], counts[1], counts[2]
        good = jnp.isfinite(loss) if skip_nonfinite else jnp.isfinite(loss) & (skipped == 0)
        kept = jax.tree.map(
            lambda new, old: jnp.where(good, new, old),
            (new_trainable, new_non_trainable, new_optimizer_state, new_metrics),
            (trainable, non_trainable, optimizer_state, metrics),
        )
        first_skipped = jnp.where(good | (first_skipped >= 0), first_skipped, steps)
        counts = jnp.stack([steps + 1, skipped + (~good).astype(jnp.int32), first_skipped])
        return (*kept, counts)

    everywhere, per_replica = replicated(mesh), batch_sharded(mesh)
    return jax.jit(
        train_step,
        donate_argnums=0,
        out_shardings=(everywhere, everywhere, everywhere, per_replica, everywhere),
    )


def make_test_step(
    model: keras.Model, mesh: Mesh
) -> Callable[[tuple[list[Any], list[Any]], list[Any], Batch], list[Any]]:
    """Loss and metrics on one global batch: ``(weights, metric stacks, batch) -> metric stacks``."""
    update_metrics = make_metric_update(model, mesh)

    def test_step(weights: tuple[list[Any], list[Any]], metrics: list[Any], batch: Batch) -> list[Any]:
        trainable, non_trainable = weights
        with padding_aware(model, batch.mask, real_rows=batch.real_rows):
            loss, (y_pred, _, increments) = _loss_and_updates(model, trainable, non_trainable, batch, training=False)
        return update_metrics(metrics, increments, loss, batch, y_pred)

    return jax.jit(test_step, donate_argnums=1, out_shardings=batch_sharded(mesh))


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
    batch: Batch,
    *,
    training: bool,
) -> tuple[Any, tuple[Any, list[Any], list[Any]]]:
    """Keras's ``compute_loss_and_updates`` with the exact per-row loss weights.

    The metric states returned are this batch's increments (per-output loss trackers).
    """
    y_pred, non_trainable, losses = cast(Any, model.stateless_call)(
        trainable, non_trainable, batch.x, return_losses=True, **_training_kwarg(model, training)
    )
    if losses:  # forward-pass losses (add_loss) reach compute_loss through this override, as in Keras
        model._losses_override = losses
    try:
        loss, (_, non_trainable, metrics) = model.stateless_compute_loss(
            trainable,
            non_trainable,
            zero_states(model),
            x=batch.x,
            y=batch.y,
            y_pred=y_pred,
            sample_weight=row_weights(batch, scale_to_real_rows=True),
            training=training,
        )
    finally:
        model._losses_override = []
    return loss, (y_pred, non_trainable, metrics)
