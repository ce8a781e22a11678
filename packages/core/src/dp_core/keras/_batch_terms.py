"""Terms a Keras step computes over the whole batch rather than row by row, and how a
trainer keeps them ``model.fit``'s.

A compiled loss is a per-row value that a trainer reduces over the real rows of the global
batch (``_losses``). Some terms see the batch only as a whole: BatchNormalization's moments in
training, an overridden ``compute_loss`` that adds something of ``y_pred``, an ``add_loss``
term a layer computes from its inputs. Padding rows would count in them, so when the epoch's
last batch is short and the model holds such a term (``batch_terms``), the trainers run that
batch unpadded and whole on every replica, its gradient counted once
(``runs_last_batch_whole``): the same program as ``model.fit``'s on its short last batch.
Full batches keep their split, where such a term is exact when it is a mean over the rows
(each replica's half-batch mean, averaged); where a replica computes it on its own rows
(torch_dp), ``warn_terms_not_split`` names a term that is not.

A metric whose function returns one value per batch (``MeanMetricWrapper`` of a batch RMSE)
has no per-row values to weigh or split: ``check_batch_metrics`` refuses it before training.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from dp_core._data import flatten, map_structure
from dp_core.keras import _internals
from dp_core.keras._inputs import FirstRows
from dp_core.keras._losses import _added_losses, _probe_added_losses, _row_dependent_added_losses, state_kept

ops: Any = keras.ops


@dataclass(frozen=True)
class BatchTerms:
    """What in a model is computed over the batch as a whole: the BatchNormalization layers that
    normalize over it in training, whether the model overrides ``compute_loss``, and the layers
    whose ``add_loss`` term depends on the rows."""

    batch_norm: tuple[str, ...] = ()
    compute_loss: bool = False
    added_losses: tuple[str, ...] = ()

    @property
    def any(self) -> bool:
        return bool(self.batch_norm or self.compute_loss or self.added_losses)


def batch_terms(model: keras.Model, inputs: FirstRows | None = None) -> BatchTerms:
    """The model's terms over the batch; ``inputs`` (its first rows) to probe ``add_loss`` terms
    (run once per model, in inference mode: see ``_losses.warn_added_losses_see_padding``)."""
    batch_norm = tuple(
        layer.name
        for layer in _internals.flatten_layers(model)
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable and 0 in _batch_axes(layer)
    )
    added: list[str] = []
    if inputs is not None:
        added = _row_dependent_added_losses.get(model)  # type: ignore[assignment]
        if added is None:
            added = _row_dependent_added_losses[model] = _probe_added_losses(model, inputs)
    own = type(model).compute_loss is not keras.Model.compute_loss
    return BatchTerms(batch_norm, own, tuple(added))


def adopt_batch_terms(model: keras.Model, terms: BatchTerms) -> None:
    """``model``'s ``add_loss`` probe taken as ``terms`` says (another replica's): where a replica holds
    only its part of the weights, the probe runs where they can be read whole, and the others adopt it."""
    _row_dependent_added_losses[model] = list(terms.added_losses)


def runs_last_batch_whole(
    model: keras.Model,
    inputs: FirstRows | None,
    *,
    num_samples: int | None,
    global_batch_size: int,
    training: bool = True,
) -> bool:
    """Whether the epoch's short last batch runs unpadded and whole on every replica: it is
    short (``num_samples`` does not divide; None, a source of unknown length: it may be) and
    the model computes a term over the batch (``batch_terms``; in inference, ``training=False``,
    BatchNormalization uses its moving statistics and does not count)."""
    if num_samples is not None and num_samples % global_batch_size == 0:
        return False
    terms = batch_terms(model, inputs)
    return terms.any if training else terms.compute_loss or bool(terms.added_losses)


def _batch_axes(layer: keras.layers.BatchNormalization) -> tuple[int, ...]:
    try:
        return _internals.batch_norm_reduction_axes(layer)
    except Exception:  # not built yet: Keras normalizes over every axis but the features
        return (0,)


def check_batch_metrics(model: keras.Model, inputs: FirstRows) -> None:
    """A ``ValueError`` before training, naming the metric, when a compiled metric's function
    returns one value for the whole batch instead of one per sample.

    A trainer splits each global batch over replicas and pads the last one: it needs a value per
    row to leave padding out and to sum the replicas' parts, and a batch value computed on half
    the rows (a root, a ratio) is not the global batch's. Asks the functions given to
    ``compile(metrics=..., weighted_metrics=...)`` (plain or in a ``MeanMetricWrapper``) of a
    one-output model, on its first rows in inference mode; builds nothing.
    """
    functions = _metric_functions(model)
    if not functions:
        return
    x, y, _ = (map_structure(ops.convert_to_tensor, part) for part in inputs.first_rows(2))
    with state_kept(model):
        y_pred = model(x, **_internals.training_kwargs(model, False))
    if y is None or len(keras.tree.flatten(y)) != 1 or len(keras.tree.flatten(y_pred)) != 1:
        return  # several outputs: which metric reads which is Keras's to match
    y, y_pred = keras.tree.flatten(y)[0], keras.tree.flatten(y_pred)[0]
    rows = int(y_pred.shape[0])
    for name, function, kwargs in functions:
        values = ops.convert_to_tensor(function(y, y_pred, **kwargs))
        if len(values.shape) == 0 or values.shape[0] != rows:
            raise ValueError(_batch_metric_message(name, function, values, rows))


def _metric_functions(model: keras.Model) -> list[tuple[str, Callable[..., Any], dict[str, Any]]]:
    """``(name, function, its keyword arguments)`` of each metric of ``compile`` that is a Python
    function or a ``MeanMetricWrapper`` (Keras wraps a function in one)."""
    compile_metrics = _internals.compile_metrics(model)
    if compile_metrics is None:
        return []
    found = []
    for metric in keras.tree.flatten(_internals.given_metrics(compile_metrics)):
        wrapped = _internals.wrapped_function(metric) if isinstance(metric, keras.metrics.MeanMetricWrapper) else None
        if wrapped is not None:
            found.append((metric.name, *wrapped))
        elif callable(metric) and not isinstance(metric, keras.metrics.Metric | type):
            found.append((getattr(metric, "__name__", type(metric).__name__), metric, {}))
    return found


def _batch_metric_message(name: str, function: Callable[..., Any], values: Any, rows: int) -> str:
    function_name = getattr(function, "__name__", type(function).__name__)
    return (
        f"The metric {name!r} (function {function_name}) returns one value per batch: on {rows} rows "
        f"its function returns shape {tuple(values.shape)}, expected ({rows},) or ({rows}, ...), one value per "
        "sample. A data-parallel trainer splits each global batch over replicas and pads the last one; it can "
        "weigh, mask and sum per-sample values, but a value of a whole batch computed on part of it (a root, a "
        "ratio) is not the global batch's. Return per-sample values (e.g. the squared error of each row, "
        "reduced over every axis but 0) and take the root of the epoch's mean, use a stateful Keras metric "
        "(keras.metrics.RootMeanSquaredError), or drop the metric from compile()."
    )


def warn_terms_not_split(model: keras.Model, inputs: FirstRows, *, num_replicas: int, package: str) -> None:
    """A warning, before the run, where each replica computes a batch term on its own rows and
    the term may not be a mean over rows: an ``add_loss`` term that is not, or an overridden
    ``compute_loss``. On a full global batch each replica computes the term on its part and the
    replicas' values are averaged, which is the global batch's value only for a mean over rows
    (``0.01 * mean(y_pred**2)`` is; a root or a variance over the batch is not).

    An ``add_loss`` term is taken as a mean over rows when its value on the first four rows is the
    mean of its values on each of them alone (the model's forward pass in inference mode). Each row
    alone, not two halves: a root of a mean is nearly linear over halves that are alike, so the
    halves of some batches pass within float32's tolerance; single rows differ more.

    A model's own ``compute_loss`` is not run to ask (``model.fit`` calls the user's code once a
    step, and a probe's calls would show in what it counts or updates): it is named, once a model.
    """
    if num_replicas < 2:
        return
    terms = batch_terms(model, inputs)
    if terms.compute_loss and model not in _own_loss_named:
        _own_loss_named.add(model)
        warnings.warn(_own_loss_message(model, num_replicas, package), UserWarning, stacklevel=3)
    if not terms.added_losses:
        return
    x, _, _ = inputs.first_rows(4)
    if len(flatten(x)[0]) < 4:  # dp_core's flatten skips an optional input fed None
        return
    parts = [slice(0, 4), *(slice(row, row + 1) for row in range(4))]
    try:
        values = [_added_losses(model, map_structure(lambda a, p=p: a[p], x)) for p in parts]
    except Exception:  # a model the probe cannot run on these rows: the run itself will tell
        return
    named = [f"the add_loss term of layer {name!r}" for name in terms.added_losses if not _splits(values, name)]
    if named:
        terms_named = " and ".join(named)
        verb = "is" if len(named) == 1 else "are"
        warnings.warn(
            f"{terms_named[0].upper()}{terms_named[1:]} {verb} not a mean over the batch's rows: its "
            f"value on 4 rows is not the mean of its values on each row. {package} computes it on each replica's "
            f"part of the global batch ({num_replicas} parts) and averages them, so it differs from model.fit's, "
            "which computes it on the whole batch. Write the term as a mean of per-row values (or a per-sample loss), "
            "or use jax_dp, which computes it on the global batch in one program.",
            UserWarning,
            stacklevel=3,
        )


# Models whose own compute_loss was named: once a model, not at every call.
_own_loss_named: weakref.WeakSet[keras.Model] = weakref.WeakSet()


def _own_loss_message(model: keras.Model, num_replicas: int, package: str) -> str:
    return (
        f"{type(model).__name__}.compute_loss is the model's own: {package} calls it as model.fit does, once a step, "
        f"on each replica's part of the global batch ({num_replicas} parts), and averages the parts. That is "
        "model.fit's loss where what it adds to Keras's loss is a mean over the batch's rows (or nothing); a term of "
        "the whole batch (a root, a variance over the rows) differs. It is not run before training to check, which "
        "would run your code more often than model.fit does. Write such a term as a mean of per-row values, or use "
        "jax_dp, which computes it on the global batch in one program."
    )


def _splits(values: list[dict[str, list[float]]], name: str, close: Callable[..., bool] = np.allclose) -> bool:
    """Whether the term's value on the whole (``values[0]``) is the mean of its values on the parts."""
    whole, *parts = (np.asarray(v.get(name, [0.0]), "float64") for v in values)
    if any(part.shape != whole.shape for part in parts):
        return False
    return close(whole, np.mean(parts, axis=0), rtol=1e-4, atol=1e-6)
