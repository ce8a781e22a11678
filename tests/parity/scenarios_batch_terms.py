"""Parity scenarios: Terms computed over a whole batch: metrics of one value per batch, `compute_loss`
overrides, batch-coupled losses.
"""

from __future__ import annotations

from typing import Any

import keras

from parity.models import ActivityPenalty, mlp, mlp_with_add_loss, numpy_weights, rng, tabular
from parity.runners import Runner
from parity.scenarios import _fit, everywhere, outcome, scenario

ops: Any = keras.ops


def batch_rmse(y_true: Any, y_pred: Any) -> Any:
    """One value for the whole batch: the root of the mean squared error over its rows."""
    return ops.sqrt(ops.mean(ops.square(ops.cast(y_true, y_pred.dtype) - y_pred)))


def _mlp_with_batch_metric() -> keras.Model:
    metric = keras.metrics.MeanMetricWrapper(batch_rmse, name="batch_rmse")
    return mlp("batch_metric", outputs=1, activation="linear", loss="mse", metrics=[metric])


@scenario(
    "feature.batch_metric",
    errors=everywhere(("ValueError",), "one value per batch"),
)
def batch_metric(run: Runner) -> Any:
    """A metric function returning one value per batch (a batch RMSE in `MeanMetricWrapper`) is refused."""
    x, y = tabular("batch_metric")
    history = _fit(run, _mlp_with_batch_metric, x, y.astype("float32"))
    return outcome(run, history, x, y.astype("float32"))


class OutputPenalty(keras.Sequential):
    """A Sequential whose ``compute_loss`` adds ``0.01 * mean(y_pred**2)`` over the batch."""

    def compute_loss(self, x: Any = None, y: Any = None, y_pred: Any = None, sample_weight: Any = None, **kwargs: Any):
        loss = super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, **kwargs)
        return loss + 0.01 * ops.mean(ops.square(y_pred))


def _mlp_with_own_compute_loss() -> keras.Model:
    model = OutputPenalty(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return numpy_weights(model, "compute_loss_batch_term")


@scenario("feature.compute_loss", "feature.batch_term")
def compute_loss_batch_term(run: Runner) -> Any:
    """`compute_loss` overridden to add `0.01 * mean(y_pred**2)` over the batch; the 3-row last batch whole."""
    x, y = tabular("compute_loss_batch_term")
    history = _fit(run, _mlp_with_own_compute_loss, x, y)
    return outcome(run, history, x, y)


class StepsBatchNorm(keras.layers.Layer):
    """BatchNormalization over every (sample, timestep) pair: a layer folding the rows into one axis."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.norm = keras.layers.BatchNormalization()

    def call(self, inputs: Any, training: Any = None) -> Any:
        shape = ops.shape(inputs)
        folded = self.norm(ops.reshape(inputs, (-1, shape[-1])), training=training)
        return ops.reshape(folded, shape)


def _steps_batch_norm() -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input((4, 6)),
            keras.layers.Dense(8),
            StepsBatchNorm(),
            keras.layers.Activation("relu"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return numpy_weights(model, "batch_norm_folded_rows")


@scenario("feature.batch_normalization", "feature.batch_term", "model.subclassed_layer")
def batch_norm_folded_rows(run: Runner) -> Any:
    """BatchNormalization on rows folded with timesteps (64 per batch): the 3-row last batch normalized whole."""
    x = rng("batch_norm_folded_rows").normal(size=(99, 4, 6)).astype("float32")
    y = (x[:, :, 0].mean(axis=1) > 0).astype("int64") + (x[:, 0, 1] > 1)
    history = _fit(run, _steps_batch_norm, x, y)
    return outcome(run, history, x, y)


def _trained_by_add_loss() -> keras.Model:
    """Compiled without ``loss=``: ``add_loss`` terms before and after the last layer are its whole loss."""
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            ActivityPenalty(0.05),
            keras.layers.Dense(3),
            ActivityPenalty(0.5),
        ]
    )
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9))
    return numpy_weights(model, "add_loss_only")


@scenario("compile.no_loss", "feature.batch_term")
def add_loss_only(run: Runner) -> Any:
    """Compiled without `loss=`, fed no `y`: two `add_loss` terms are the whole loss; the 3-row last batch whole."""
    x, _ = tabular("add_loss_only")
    history = _fit(run, _trained_by_add_loss, x)
    return outcome(run, history, x)


@scenario("feature.regularization", "feature.batch_term")
def add_loss_short_last_batch(run: Runner) -> Any:
    """A layer's `add_loss(0.05 * mean(x**2))` over the batch, 99 rows: the 3-row last batch whole."""
    x, y = tabular("add_loss_short_last_batch")
    history = _fit(run, mlp_with_add_loss, x, y)
    return outcome(run, history, x, y)
