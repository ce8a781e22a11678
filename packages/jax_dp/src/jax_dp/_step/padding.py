"""Padded rows weigh nothing: the parts of Keras that would otherwise count them.

The last global batch is padded to its full size so its shape (and the compiled step)
stays fixed. While a step is *traced*, ``padding_aware`` swaps, on the model's own
objects and only for the duration of the trace:

- each BatchNormalization layer's moments for masked ones (global batch by default,
  or per replica group with ``batch_norm="per_replica"``);
- the per-output loss trackers' weight, from the padded batch size to the real rows;
- when the batches are padded, each compiled loss's unreduced values get the padding as a
  Keras mask, so Keras's own reduction leaves padded rows out: ``sum_over_batch_size``
  divides by the values (or, with a Keras mask of the model's, the valid positions) of the
  real rows only, whatever the values' shape (per row, per timestep, per pixel). Losses
  that sum over the batch axis (``Dice``, ``Tversky``) see padded rows as zeros;
- activity regularizers, which see padded rows as zeros and divide by the real rows where
  Keras divides by the batch size.

``masked_metrics`` does the same for the compiled metrics' update, so unweighted
metrics get the mask as weight, shaped like a sample weight for the output.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, cast

import jax
import jax.numpy as jnp
import keras
import numpy as np

from dp_core import BatchNormMode
from dp_core.keras import activity_regularizer_divides_by_batch_size, internals


@contextlib.contextmanager
def padding_aware(
    model: keras.Model,
    mask: jnp.ndarray,
    *,
    real_rows: Any = None,
    padded: bool = True,
    batch_norm: BatchNormMode = "global",
    num_replicas: int = 1,
) -> Iterator[None]:
    """Within the block, ``model``'s BN statistics, losses and loss trackers ignore padded rows.

    ``real_rows`` (default: the mask's sum) is the number of real rows in the batch.
    ``padded=False`` says no batch of these steps has padding: the losses are Keras's own.
    """
    real_rows = jnp.sum(mask) if real_rows is None else real_rows
    restores: list[Callable[[], None]] = []
    try:
        for layer in internals.flatten_layers(model, include_self=True):
            if isinstance(layer, keras.layers.BatchNormalization):
                if batch_norm == "per_replica":
                    call = _replica_batch_norm_call(layer, mask, num_replicas)
                    restores.append(internals.override(layer, "call", call))
                elif padded:  # unpadded, Keras's own moments: masking them reads every activation twice more
                    restores.append(internals.override_batch_norm_moments(layer, _masked_moments(layer, mask)))
            if padded and layer.activity_regularizer is not None:
                regularize = _real_rows_activity(cast(Any, layer.activity_regularizer), mask, real_rows)
                restores.append(internals.override(layer, "activity_regularizer", regularize))
        compile_loss = internals.compile_loss(model)
        for tracker in [] if compile_loss is None else compile_loss.metrics:
            update = _per_real_row(tracker.update_state, real_rows)
            restores.append(internals.override(tracker, "update_state", update))
        if padded and compile_loss is not None and not computes_own_loss(model):
            restores.append(
                internals.override_loss_functions(compile_loss, functools.partial(_over_real_rows, mask=mask))
            )
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


def computes_own_loss(model: keras.Model) -> bool:
    """Whether the model overrides ``compute_loss``: its own loss may not use the compiled
    losses, so it gets the padding as sample weights instead (see ``_step.steps``)."""
    return type(model).compute_loss is not keras.Model.compute_loss


# Keras losses whose value is a sum over every row: a padded row of zeros adds nothing.
SUMS_OVER_ROWS = (keras.losses.Dice, keras.losses.Tversky)


def _over_real_rows(loss: Any, *, mask: jnp.ndarray) -> Any:
    """``loss`` as ``CompileLoss`` calls it, with padded rows left out of its values and
    of Keras's normalizer (the padding joins the values' Keras mask)."""
    if not isinstance(loss, keras.losses.Loss) or loss.reduction in (None, "none"):
        return loss  # unreduced: Keras's train step needs a scalar anyway
    masked_call = _masked_values(loss, loss.call, mask)

    def call(y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        restore = internals.override(loss, "call", masked_call)
        try:
            return loss(y_true, y_pred, sample_weight)
        finally:
            restore()

    return call


def _masked_values(loss: Any, values_of: Callable[[Any, Any], Any], mask: jnp.ndarray) -> Callable[[Any, Any], Any]:
    rows = mask.shape[0]

    def call(y_true: Any, y_pred: Any) -> Any:
        values = values_of(y_true, y_pred)
        if values.ndim == 0 or values.shape[0] != rows:
            if not isinstance(loss, SUMS_OVER_ROWS):
                raise ValueError(_batch_reducing_message(loss, values, rows))
            # One value for the whole batch, from real rows only; spread over the rows so
            # that a sample weight weighs it as Keras weighs a scalar loss (its mean).
            total = values_of(_zero_padding(y_true, mask), _zero_padding(y_pred, mask))
            values = jnp.broadcast_to(total, (rows,))
        real = jnp.broadcast_to(_per_row(mask, values) > 0, values.shape)
        own = internals.keras_mask(values)
        internals.set_keras_mask(values, real if own is None else jnp.logical_and(own, real))
        return values

    return call


def _zero_padding(tensor: Any, mask: jnp.ndarray) -> Any:
    return tensor * _per_row(mask, tensor).astype(tensor.dtype)


def _per_row(mask: jnp.ndarray, like: Any) -> jnp.ndarray:
    """``mask`` shaped to broadcast over ``like``'s non-batch axes."""
    return jnp.reshape(mask, (-1,) + (1,) * (len(like.shape) - 1))


def _batch_reducing_message(loss: Any, values: Any, rows: int) -> str:
    return (
        f"The loss {loss.name!r} ({type(loss).__name__}) reduces over the batch axis: on a global batch of {rows} "
        f"rows its unreduced values have shape {tuple(values.shape)}, not ({rows}, ...). The last global batch is "
        "padded to its full size, and jax_dp can leave padded rows out only of a loss with one value per sample, "
        f"or of one that sums over rows ({', '.join(c.__name__ for c in SUMS_OVER_ROWS)}). Return one loss value "
        "per sample (reduce every axis but 0), or pass a global_batch_size that divides the number of samples."
    )


def _real_rows_activity(regularizer: Callable[[Any], Any], mask: jnp.ndarray, real_rows: Any) -> Callable[[Any], Any]:
    """An activity regularizer over the real rows: padded rows are zeros (Keras's regularizers
    sum over elements) and, where Keras divides the term by the batch size, the result is
    rescaled so that the division is by the real rows."""
    scale = mask.shape[0] / real_rows if _activity_divided_by_batch_size() else 1.0

    def regularize(output: Any) -> Any:
        if len(output.shape) == 0 or output.shape[0] != mask.shape[0]:
            return regularizer(output)
        return regularizer(_zero_padding(output, mask)) * scale

    return regularize


def _activity_divided_by_batch_size() -> bool:
    """dp-core's probe of this Keras, evaluated eagerly: it may first be asked inside a trace."""
    with jax.ensure_compile_time_eval():
        return activity_regularizer_divides_by_batch_size()


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
    if getattr(layer, "renorm", False):  # Keras 3.10 has no renorm
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
    weight; the step passes ``sample_weight * mask`` here, so both skip padding. Where Keras
    would call a metric without a sample weight, a Keras mask on ``y_pred`` reaches it only
    if this Keras applies masks without one (3.10 does not).
    """

    def update_state(y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        if not compile_metrics.built:
            compile_metrics.build(y_true, y_pred)
        metrics, weighted_metrics, flatten_y = internals.compiled_metric_parts(compile_metrics)
        y_true = flatten_y(y_true)
        y_pred = flatten_y(y_pred)
        unweighted = y_pred if _metrics_mask_without_sample_weight() else [_without_keras_mask(p) for p in y_pred]
        for metric, y_t, y_p in zip(metrics, y_true, unweighted, strict=False):
            if metric:
                metric.update_state(y_t, y_p, sample_weight=_mask_like_sample_weight(mask, y_p))
        if sample_weight is None:
            y_pred = unweighted
            weights = [_mask_like_sample_weight(mask, y_p) for y_p in y_pred]
        else:
            weights = flatten_y(sample_weight)
        if len(weights) < len(y_true):  # one weight for every output, as in Keras
            weights = [weights[0]] * len(y_true)
        for metric, y_t, y_p, weight in zip(weighted_metrics, y_true, y_pred, weights, strict=False):
            if metric:
                metric.update_state(y_t, y_p, sample_weight=weight)

    return update_state


def _without_keras_mask(y_pred: Any) -> Any:
    """``y_pred``'s values without the Keras mask attached to it (a new array)."""
    return y_pred if internals.keras_mask(y_pred) is None else jnp.array(y_pred, copy=True)


@functools.cache
def _metrics_mask_without_sample_weight() -> bool:
    """Whether this Keras's metrics apply a Keras mask on ``y_pred`` when called without a sample
    weight (newer releases do, 3.10 does not): asked of Keras itself, once, outside any trace."""
    with jax.ensure_compile_time_eval():
        y_pred = keras.ops.convert_to_tensor(np.array([1.0, 0.0], "float32"))
        internals.set_keras_mask(y_pred, keras.ops.convert_to_tensor(np.array([True, False])))
        probe = keras.metrics.MeanMetricWrapper(lambda y_true, y_pred: y_pred, name="jax_dp_mask_probe")
        probe.update_state(keras.ops.zeros((2,)), y_pred)
        return np.asarray(keras.ops.convert_to_numpy(probe.result())).item() == 1.0


def _mask_like_sample_weight(mask: jnp.ndarray, y_pred: Any) -> jnp.ndarray:
    """The row mask with the rank of a sample weight for ``y_pred``: ``(B,)`` for one value
    per row, ``(B, 1)`` for ``(B, T, C)`` outputs, ``(B, 1, 1)`` per pixel, so Keras broadcasts
    it over the metric's values (and its Keras mask) as over a user's sample weight."""
    return jnp.reshape(mask, (-1,) + (1,) * max(len(y_pred.shape) - 2, 0))


def _per_real_row(update_state: Callable[..., Any], real_rows: jnp.ndarray) -> Callable[..., Any]:
    # Keras weighs a batch's loss by its padded size; a smaller real batch weighs less.
    def update(values: Any, sample_weight: Any = None) -> Any:
        return update_state(values, sample_weight=real_rows)

    return update
