"""A replica's share of the single-device loss of a global batch, for every backend.

Keras reduces a loss over the rows it is given: ``sum_over_batch_size`` divides the sum of
the loss values by their number, or, when the output carries a Keras mask, by the number of
valid mask positions. A replica holds only part of the global batch, and on the last batch
part of it is padding, so its own reduction is not the single-device one. Within
``replica_losses`` every compiled loss returns ``num_replicas`` times this replica's share
instead: the sum of its real rows' loss values over the normalizer of the *whole* global
batch (a mask's valid positions are summed over replicas). The mean over replicas of the
loss, and of its gradient, is then exactly what ``model.fit`` computes on that batch.

Activity regularizers get the same treatment (padded rows left out, Keras's division by the
batch size replaced by the global batch's real rows). ``add_loss`` terms computed in a
layer's ``call`` are the user's own function of the batch and stay per replica: constant
terms count once per global batch, batch-dependent ones are the mean over replicas (exact
for a mean over the rows). No trainer can take padding rows out of them: the trainers run a
short last batch whole instead (``_batch_terms.runs_last_batch_whole``);
``warn_added_losses_see_padding`` is for a caller that pads it anyway.

The mask counted is the one on ``y_pred`` (Keras also merges a mask a loss function puts on
its own values, which no Keras loss does). A loss whose values have no batch axis
(``keras.losses.Dice()`` with ``axis=None``, or a user loss that reduces over axis 0) cannot
be split; ``check_losses_split`` says so before training.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from dp_core._data import flatten, map_structure
from dp_core.keras import _internals
from dp_core.keras._inputs import FirstRows

# keras.ops is typed for every backend at once; treat it as untyped here.
ops: Any = keras.ops

_SPLITTABLE = ("sum_over_batch_size", "mean", "sum", "mean_with_sample_weight")


def _no_communication(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class ReplicaRows:
    """This replica's part of one global batch, as its loss must see it.

    ``row_mask`` (shape ``(rows,)``, 1 for real rows, 0 for padding) is None when every row of
    the global batch is real; ``sum_over_replicas`` sums a tensor over replicas (a backend's
    all-reduce; the identity where one program sees the whole global batch).
    """

    rows: int
    global_real_rows: int
    num_replicas: int = 1
    row_mask: Any = None
    sum_over_replicas: Callable[[Any], Any] = _no_communication

    @property
    def whole_batch(self) -> bool:
        """Whether these rows are the whole global batch, every one real: Keras's own reduction is exact."""
        return self.num_replicas == 1 and self.row_mask is None


@contextlib.contextmanager
def replica_losses(model: keras.Model, rows: ReplicaRows) -> Iterator[None]:
    """Within the block (the forward pass and ``compute_loss``), ``model``'s compiled losses and
    activity regularizers give ``rows.num_replicas`` times this replica's share of the
    single-device loss of the global batch. The whole global batch, every row real, is left to Keras's
    own reduction, which is then the single-device one (one replica's full batch)."""
    if rows.whole_batch:
        yield
        return
    restores: list[Callable[[], None]] = []
    try:
        compile_loss = _internals.compile_loss(model)
        if compile_loss is not None:
            restores.append(_internals.override_loss_functions(compile_loss, functools.partial(_share_of, rows=rows)))
        scale = _activity_scale(rows)
        if scale != 1.0 or rows.row_mask is not None:
            for layer in _internals.flatten_layers(model, include_self=True):
                regularizer: Any = layer.activity_regularizer
                if regularizer is not None:
                    regularize = _activity_share(regularizer, rows, scale)
                    restores.append(_internals.override(layer, "activity_regularizer", regularize))
        yield
    finally:
        for restore in reversed(restores):
            restore()


def check_losses_split(model: keras.Model, inputs: FirstRows) -> None:
    """A ``ValueError`` naming the loss, before training, when a compiled loss reduces over the
    batch axis (its values on a few rows have no row axis), so no replica's share of it exists.

    Runs the model in inference mode on the first rows and asks the compiled loss itself, never the
    model's ``compute_loss`` (a model's own is the user's code, which ``model.fit`` runs once a step
    and no more); metric states are left as they were. A model's own ``compute_loss`` may hand the
    compiled loss other predictions than the model's outputs (one of Keras's tests makes two of one), which
    only running it would show: when the outputs do not fit the compiled loss then, nothing is said here,
    and the step's share raises the same error at the first step.
    """
    compile_loss = _internals.compile_loss(model)
    if compile_loss is None:
        return  # no compiled loss: nothing to split
    first = inputs.first_rows(2)
    count = len(flatten(first[0])[0])  # dp_core's flatten skips an optional input fed None
    x, y, sample_weight = (map_structure(ops.convert_to_tensor, part) for part in first)
    # A row mask of ones: every row is real, yet the loss must split (Keras's own reduction is not used).
    rows = ReplicaRows(count, count, row_mask=ops.ones((count,)))
    with state_kept(model), replica_losses(model, rows):
        y_pred = model(x, **_internals.training_kwargs(model, False))
        try:
            compile_loss(y, y_pred, sample_weight)
        except _UnsplittableLossError:
            raise
        except Exception:
            if type(model).compute_loss is keras.Model.compute_loss:
                raise  # Keras's own error about the outputs and the loss, as model.fit would give it


@contextlib.contextmanager
def state_kept(model: keras.Model) -> Iterator[None]:
    """Within the block a check may run the model (in inference mode) and leave no trace: the metrics'
    states, the random layers' seed states and the model's other non-trainable variables are put back
    after it (a layer that draws noise at inference, MC dropout, advances its ``SeedGenerator``; a
    ``call`` may count itself in a variable, as one of Keras's tests does: ``model.fit`` runs it no more)."""
    layers = _internals.flatten_layers(model, include_self=True)
    seeds = [generator.state for layer in layers for generator in _internals.seed_generators(layer)]
    # Keras's own layers change no variable at inference (BatchNormalization's statistics move in training
    # only): theirs are not read, so a model built in a trainer's scope is not read whole for them
    kept = [v for layer in layers if _keras_own_layer(layer) for v in layer.non_trainable_variables]
    seen = {id(variable) for variable in [*model.metrics_variables, *seeds, *kept]}
    others = [variable for variable in model.non_trainable_variables if id(variable) not in seen]
    variables = [*model.metrics_variables, *seeds, *others]
    states = [ops.convert_to_numpy(variable) for variable in variables]
    try:
        yield
    finally:
        for variable, state in zip(variables, states, strict=True):
            variable.assign(state)


def _keras_own_layer(layer: keras.layers.Layer) -> bool:
    """A layer class of Keras's own layers (not of its test files: their counters are put back), not a model."""
    return type(layer).__module__.startswith("keras.src.layers.") and not isinstance(layer, keras.Model)


def _share_of(loss: Any, *, rows: ReplicaRows) -> Callable[..., Any]:
    """``loss`` as ``CompileLoss`` calls it, returning this replica's scaled share."""
    if getattr(loss, "reduction", None) not in _SPLITTABLE:
        return loss  # "none" and None: as Keras (whose train step needs a scalar loss anyway)

    def share(y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        values = _unreduced(loss, y_true, y_pred, sample_weight)
        if len(values.shape) == 0 or values.shape[0] != rows.rows:
            if rows.whole_batch:
                return loss(y_true, y_pred, sample_weight)
            raise _UnsplittableLossError(_unsplittable(loss, values, rows.rows))
        total = ops.sum(values if rows.row_mask is None else values * _per_row(rows.row_mask, values))
        if loss.reduction == "sum":
            return total * rows.num_replicas
        return ops.divide_no_nan(total, _normalizer(loss.reduction, values, y_pred, sample_weight, rows))

    return share


class _UnsplittableLossError(ValueError):
    """A compiled loss without one value per row (``_unsplittable`` says which and what to do)."""


def _unreduced(loss: Any, y_true: Any, y_pred: Any, sample_weight: Any) -> Any:
    """The loss values, weighted and masked as Keras weighs them, before any reduction."""
    reduction = loss.reduction
    loss.reduction = "none"
    try:
        return loss(y_true, y_pred, sample_weight)
    finally:
        loss.reduction = reduction


def _normalizer(reduction: str, values: Any, y_pred: Any, sample_weight: Any, rows: ReplicaRows) -> Any:
    """The single-device reduction's divisor for the global batch, over ``num_replicas``.

    Keras divides by the number of values (``sum_over_batch_size``), scaled by
    ``mask size / valid positions`` with a mask, or by the sum of the merged weights
    (``mean_with_sample_weight``); here each is counted over the real rows of every replica.
    """
    mask = _internals.keras_mask(y_pred)
    dtype = values.dtype
    if reduction == "mean_with_sample_weight" and (mask is not None or sample_weight is not None):
        weights = [ops.cast(w, dtype) for w in (mask, sample_weight) if w is not None]
        merged = weights[0] if len(weights) == 1 else ops.multiply(*_same_rank(*weights))
        return rows.sum_over_replicas(ops.sum(merged * _per_row(_row_mask(rows, dtype), merged))) / rows.num_replicas
    values_per_row = int(np.prod(values.shape[1:]))
    if mask is None or reduction == "mean_with_sample_weight":
        return ops.convert_to_tensor(rows.global_real_rows * values_per_row / rows.num_replicas, dtype)
    mask = ops.cast(mask, dtype)
    valid = rows.sum_over_replicas(ops.sum(mask * _per_row(_row_mask(rows, dtype), mask)))
    mask_per_row = int(np.prod(mask.shape[1:]))
    return valid * (values_per_row / (mask_per_row * rows.num_replicas))


def _row_mask(rows: ReplicaRows, dtype: Any) -> Any:
    return ops.ones((rows.rows,), dtype) if rows.row_mask is None else ops.cast(rows.row_mask, dtype)


def _per_row(row_mask: Any, like: Any) -> Any:
    """``row_mask`` shaped to broadcast over ``like``'s non-batch axes."""
    return ops.reshape(ops.cast(row_mask, like.dtype), (-1,) + (1,) * (len(like.shape) - 1))


def _same_rank(first: Any, second: Any) -> tuple[Any, Any]:
    """Keras's rule for a mask and a sample weight whose ranks differ by a trailing axis of 1."""
    if len(first.shape) == len(second.shape) + 1 and first.shape[-1] == 1:
        return (first, ops.expand_dims(second, -1)) if len(second.shape) == 1 else (ops.squeeze(first, -1), second)
    if len(second.shape) == len(first.shape) + 1 and second.shape[-1] == 1:
        return (ops.expand_dims(first, -1), second) if len(first.shape) == 1 else (first, ops.squeeze(second, -1))
    return first, second


def _unsplittable(loss: Any, values: Any, rows: int) -> str:
    return (
        f"The loss {loss.name!r} ({type(loss).__name__}) reduces over the batch axis: on {rows} rows its "
        f"unreduced values have shape {tuple(values.shape)}, not ({rows}, ...). A data-parallel trainer splits "
        "each global batch over replicas and pads the last one, which needs one loss value per sample (Keras "
        "then averages them). Use a per-sample loss (e.g. keras.losses.Dice(axis=(1, 2, 3)) for images, or a "
        "loss that reduces every axis but 0), or jax_dp, which computes the loss over each global batch in one "
        "program; with torch_dp, num_replicas=1 and a global batch that divides the data are exact too."
    )


def _activity_scale(rows: ReplicaRows) -> float:
    """The factor that makes the mean over replicas of a replica's activity regularizer term
    the single-device one: Keras divides the term by the batch size (3.11+) or sums it."""
    if activity_regularizer_divides_by_batch_size():
        return rows.num_replicas * rows.rows / rows.global_real_rows
    return float(rows.num_replicas)


def _activity_share(regularizer: Callable[[Any], Any], rows: ReplicaRows, scale: float) -> Callable[[Any], Any]:
    def regularize(output: Any) -> Any:
        if rows.row_mask is not None and len(output.shape) > 0 and output.shape[0] == rows.rows:
            output = output * _per_row(rows.row_mask, output)
        return regularizer(output) * scale

    return regularize


@functools.cache
def activity_regularizer_divides_by_batch_size() -> bool:
    """Whether this Keras divides an activity regularizer's term by the batch size (newer
    releases do, 3.10 does not): asked of Keras itself, once."""
    layer = keras.layers.Activation("linear", activity_regularizer=ops.sum, name="dp_core_activity_probe")
    layer(ops.ones((2, 1)))
    return float(np.asarray(ops.convert_to_numpy(layer.losses[0]))) == 1.0


def warn_added_losses_see_padding(model: keras.Model, inputs: FirstRows, *, num_samples: int, batch_size: int) -> None:
    """A warning, before the run, when a layer's ``add_loss`` term depends on the rows it is
    given and the last of ``num_samples // batch_size + 1`` batches is padded: the padding
    rows count in that term there, where model.fit computes it over the real rows only.

    A term is taken to depend on the rows when two single rows give two different values
    (constant terms and weight regularizers do not). Runs the model in inference mode.
    """
    if num_samples % batch_size == 0:
        return
    layers = _row_dependent_added_losses.get(model)
    if layers is None:
        layers = _row_dependent_added_losses[model] = _probe_added_losses(model, inputs)
    if not layers:
        return
    real = num_samples % batch_size
    warnings.warn(
        f"{'Layer' if len(layers) == 1 else 'Layers'} {', '.join(repr(name) for name in layers)} "
        f"{'adds' if len(layers) == 1 else 'add'} a loss with add_loss() that depends on the batch's rows. "
        f"The last batch holds {real} of {batch_size} rows ({num_samples} samples) and is padded up to a full "
        "batch (one compiled step serves every batch, and replicas get equal shares), so on that batch the "
        f"padding rows count in the term, where model.fit computes it over the {real} real rows. To be exact, "
        f"choose a batch size that divides {num_samples}, or express the term as a per-sample loss or an "
        "activity_regularizer (both are counted over real rows only).",
        UserWarning,
        stacklevel=3,
    )


# Asked once per model: the probe runs the model, which later calls should not pay again.
_row_dependent_added_losses: weakref.WeakKeyDictionary[keras.Model, list[str]] = weakref.WeakKeyDictionary()


def _probe_added_losses(model: keras.Model, inputs: FirstRows) -> list[str]:
    """The layers whose ``add_loss`` terms differ between the first two rows."""
    x, _, _ = inputs.first_rows(2)
    leaves = flatten(x)
    if not leaves:  # every input fed None: nothing to probe; the model's own call says what is missing
        return []
    rows = len(leaves[0])
    try:
        terms = [_added_losses(model, map_structure(lambda a, i=i: a[i : i + 1], x)) for i in range(min(rows, 2))]
    except Exception:  # a model without call() (its train_step does the work): the run itself will tell
        return []
    return [name for name, values in terms[0].items() if rows < 2 or values != terms[1].get(name)]


def _added_losses(model: keras.Model, x: Any) -> dict[str, list[float]]:
    """The ``add_loss`` terms each layer adds on ``x`` (activity regularizers switched off)."""
    layers = _internals.flatten_layers(model, include_self=True)
    restores = [
        _internals.override(layer, "activity_regularizer", None)
        for layer in layers
        if layer.activity_regularizer is not None
    ]
    try:
        with state_kept(model):
            model(map_structure(ops.convert_to_tensor, x), **_internals.training_kwargs(model, False))
    finally:
        for restore in reversed(restores):
            restore()
    terms = {layer.name: _internals.added_losses(layer) for layer in layers}
    return {name: [float(np.asarray(ops.convert_to_numpy(t))) for t in own] for name, own in terms.items() if own}
