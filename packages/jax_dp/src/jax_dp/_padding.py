"""Padded rows weigh nothing: the parts of Keras that would otherwise count them.

The last global batch is padded to its full size so its shape (and the compiled step)
stays fixed. While a step is *traced*, ``padding_aware`` swaps, on the model's own
objects and only for the duration of the trace:

- each BatchNormalization layer's moments for masked ones (global batch by default,
  or per replica group with ``batch_norm="per_replica"``);
- the per-output loss trackers' weight, from the padded batch size to the real rows.

``masked_metrics`` does the same for the compiled metrics' update, so unweighted
metrics get the mask as weight.

The loss itself is made exact through sample weights (see ``_steps``), not here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import jax.numpy as jnp
import keras

from dp_core import BatchNormMode
from dp_core.keras import internals


@contextlib.contextmanager
def padding_aware(
    model: keras.Model,
    mask: jnp.ndarray,
    *,
    real_rows: Any = None,
    batch_norm: BatchNormMode = "global",
    num_replicas: int = 1,
) -> Iterator[None]:
    """Within the block, ``model``'s BN statistics and loss trackers ignore padded rows.

    ``real_rows`` (default: the mask's sum) is the number of real rows in the batch.
    """
    real_rows = jnp.sum(mask) if real_rows is None else real_rows
    restores: list[Callable[[], None]] = []
    try:
        for layer in internals.flatten_layers(model, include_self=True):
            if isinstance(layer, keras.layers.BatchNormalization):
                if batch_norm == "per_replica":
                    call = _replica_batch_norm_call(layer, mask, num_replicas)
                    restores.append(internals.override(layer, "call", call))
                else:
                    restores.append(internals.override_batch_norm_moments(layer, _masked_moments(layer, mask)))
        compile_loss = internals.compile_loss(model)
        for tracker in [] if compile_loss is None else compile_loss.metrics:
            update = _per_real_row(tracker.update_state, real_rows)
            restores.append(internals.override(tracker, "update_state", update))
        yield
    finally:
        for restore in reversed(restores):
            restore()


@contextlib.contextmanager
def masked_metrics(model: keras.Model, mask: jnp.ndarray) -> Iterator[None]:
    """Within the block, ``model``'s compiled metrics weigh padded rows zero."""
    compile_metrics = internals.compile_metrics(model)
    if compile_metrics is None:
        yield
        return
    restore = internals.override(compile_metrics, "update_state", _masked_metrics_update(compile_metrics, mask))
    try:
        yield
    finally:
        restore()


def _batch_weights(inputs: jnp.ndarray, mask: jnp.ndarray, keras_mask: Any) -> jnp.ndarray:
    weights = jnp.reshape(mask.astype(inputs.dtype), (inputs.shape[0],) + (1,) * (inputs.ndim - 1))
    if keras_mask is not None:
        weights = weights * jnp.expand_dims(jnp.asarray(keras_mask, inputs.dtype), -1)
    return jnp.broadcast_to(weights, inputs.shape)


def _weighted_moments(inputs: jnp.ndarray, weights: jnp.ndarray, axes: tuple[int, ...]) -> tuple[Any, Any]:
    # Biased variance, two passes, like jnp.var in Keras's own moments.
    count = jnp.maximum(jnp.sum(weights, axes, keepdims=True), 1.0)
    mean = jnp.sum(inputs * weights, axes, keepdims=True) / count
    variance = jnp.sum(jnp.square(inputs - mean) * weights, axes, keepdims=True) / count
    return mean, variance


def _masked_moments(layer: Any, mask: jnp.ndarray) -> Callable[..., Any]:
    original = internals.batch_norm_moments(layer)

    def moments(inputs: Any, keras_mask: Any) -> tuple[Any, Any]:
        axes = internals.batch_norm_reduction_axes(layer)
        if 0 not in axes or inputs.shape[0] != mask.shape[0]:
            return original(inputs, keras_mask)  # batch rows not pooled here: padding cannot leak
        inputs = jnp.asarray(inputs)
        mean, variance = _weighted_moments(inputs, _batch_weights(inputs, mask, keras_mask), axes)
        return jnp.squeeze(mean, axes), jnp.squeeze(variance, axes)

    return moments


def _replica_batch_norm_call(layer: Any, batch_mask: jnp.ndarray, num_replicas: int) -> Callable[..., Any]:
    """BN that normalizes each replica's rows with that replica's own moments.

    The moving statistics move towards the mean of the replicas' moments (replicas
    holding only padding excluded), so the replicated state stays one value.
    """
    if layer.renorm:
        raise ValueError(f"batch_norm='per_replica' does not support BatchNormalization(renorm=True) ({layer.name}).")
    original = layer.call

    def call(inputs: Any, training: Any = None, mask: Any = None) -> Any:
        keras_mask = mask
        if not (training and layer.trainable) or inputs.shape[0] != batch_mask.shape[0]:
            return original(inputs, training=training, mask=keras_mask)
        x = jnp.asarray(inputs).astype(jnp.result_type(inputs.dtype, jnp.float32))
        groups = (num_replicas, x.shape[0] // num_replicas, *x.shape[1:])
        axes = tuple(a + 1 for a in internals.batch_norm_reduction_axes(layer))
        weights = jnp.reshape(_batch_weights(x, batch_mask, keras_mask), groups)
        mean, variance = _weighted_moments(jnp.reshape(x, groups), weights, axes)
        inv = jnp.reciprocal(jnp.sqrt(variance + layer.epsilon))
        if layer.scale:
            inv = inv * _channel_shaped(layer.gamma, layer.axis % x.ndim, x.ndim)
        offset = _channel_shaped(layer.beta, layer.axis % x.ndim, x.ndim) if layer.center else 0.0
        outputs = jnp.reshape(jnp.reshape(x, groups) * inv + (offset - mean * inv), x.shape)
        has_rows = (jnp.sum(weights, axes, keepdims=True) > 0).astype(x.dtype)
        num_with_rows = jnp.maximum(jnp.sum(has_rows, axis=0), 1.0)  # per channel
        for moving, batch_value in ((layer.moving_mean, mean), (layer.moving_variance, variance)):
            replica_mean = jnp.reshape(jnp.sum(batch_value * has_rows, axis=0) / num_with_rows, moving.shape)
            moving.assign(moving.value * layer.momentum + replica_mean * (1.0 - layer.momentum))
        return outputs.astype(layer.compute_dtype)

    return call


def _channel_shaped(variable: Any, axis: int, ndim: int) -> jnp.ndarray:
    shape = [1] * (ndim + 1)  # +1: the leading replica-group axis
    shape[axis + 1] = -1
    return jnp.reshape(jnp.asarray(cast(Any, keras.ops.convert_to_tensor(variable))), shape)


def _masked_metrics_update(compile_metrics: Any, mask: jnp.ndarray) -> Callable[..., None]:
    """CompileMetrics.update_state with the mask as weight of the unweighted metrics.

    Keras gives ``metrics=`` no sample weight and ``weighted_metrics=`` the sample
    weight; the step passes ``sample_weight * mask`` here, so both skip padding.
    """

    def update_state(y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        if not compile_metrics.built:
            compile_metrics.build(y_true, y_pred)
        metrics, weighted_metrics, flatten_y = internals.compiled_metric_parts(compile_metrics)
        y_true = flatten_y(y_true)
        y_pred = flatten_y(y_pred)
        for metric, y_t, y_p in zip(metrics, y_true, y_pred, strict=False):
            if metric:
                metric.update_state(y_t, y_p, sample_weight=mask)
        weights = [mask] * len(y_true) if sample_weight is None else flatten_y(sample_weight)
        if len(weights) < len(y_true):  # one weight for every output, as in Keras
            weights = [weights[0]] * len(y_true)
        for metric, y_t, y_p, weight in zip(weighted_metrics, y_true, y_pred, weights, strict=False):
            if metric:
                metric.update_state(y_t, y_p, sample_weight=weight)

    return update_state


def _per_real_row(update_state: Callable[..., Any], real_rows: jnp.ndarray) -> Callable[..., Any]:
    # Keras weighs a batch's loss by its padded size; a smaller real batch weighs less.
    def update(values: Any, sample_weight: Any = None) -> Any:
        return update_state(values, sample_weight=real_rows)

    return update
