"""``check_equivalence`` written once: train a model on 1 replica and on N from the same
weights and data, compare them layer by layer, and name the differences the model has by design.

A backend injects how it trains (``Train``: a ``Trainer(num_replicas).fit``). Random layers are
no difference: both backends draw the global batch's noise, as one device does, and every run
starts from the same seed states and torch generator state. With ``rounding_baseline``, 1 replica trains a third
time on each float input element times ``1 +- NUDGE``: how far rounding alone moves that model.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, cast

import keras
import numpy as np

from dp_core._batch import padded_batch_size
from dp_core._data import flatten, is_map_dataset, map_structure
from dp_core._equivalence import DEFAULT_TOLERANCE, NUDGE, EquivalenceReport, relative_difference
from dp_core._options import BatchNormMode, check_batch_norm_mode
from dp_core.keras import _internals
from dp_core.keras._arguments import batch_source
from dp_core.keras._inputs import Inputs
from dp_core.keras._model import build_model, compile_like, resolve_model
from dp_core.keras._sources import is_batch_source

LOW_PRECISION = ("float16", "bfloat16")


class Train(Protocol):
    """A backend's ``Trainer(num_replicas, batch_norm=...).fit(model, **fit_arguments)``."""

    def __call__(self, num_replicas: int, model: Any, /, **fit_arguments: Any) -> keras.callbacks.History: ...


def compare_replica_counts(
    train: Train,
    model: Any,
    x: Any,
    y: Any = None,
    *,
    global_batch_size: int,
    steps: int = 5,
    num_replicas: int = 2,
    tolerance: float = DEFAULT_TOLERANCE,
    seed: int = 0,
    batch_norm: BatchNormMode = "global",
    rounding_baseline: bool = False,
) -> EquivalenceReport:
    """Train copies of ``model`` (a compiled model, left untouched, or a factory) for ``steps``
    global batches on 1 replica and on ``num_replicas``, and compare them (see ``check_equivalence``).
    With ``rounding_baseline``, a third copy trains on 1 replica on ``nudged(x)``."""
    _check_arguments(global_batch_size, steps, num_replicas, tolerance)
    check_batch_norm_mode(batch_norm)
    x, y, steps_per_epoch = first_steps(x, y, global_batch_size=global_batch_size, steps=steps)
    nudged_x = nudged(x) if rounding_baseline else None  # refused before anything trains
    first, second, *third = starting_models(model, x, y, count=3 if rounding_baseline else 2)
    fit_arguments = {
        "x": x,
        "y": y,
        "global_batch_size": global_batch_size,
        "epochs": 1,
        "steps_per_epoch": steps_per_epoch,
        "shuffle": False,
        "seed": seed,
        "verbose": 0,
    }
    one, many = LossCurve(), LossCurve()
    same_stream = _torch_generator_kept()
    reference = _trained(train(1, first, callbacks=[one], **fit_arguments))
    same_stream()
    replicated = _trained(train(num_replicas, second, callbacks=[many], **fit_arguments))
    baseline, baseline_curve = None, LossCurve()
    if third:
        same_stream()
        arguments = {**fit_arguments, "x": nudged_x}
        baseline = weight_differences(reference, _trained(train(1, third[0], callbacks=[baseline_curve], **arguments)))
    return EquivalenceReport(
        num_replicas=num_replicas,
        global_batch_size=global_batch_size,
        layer_differences=weight_differences(reference, replicated),
        losses=tuple(one.losses),
        replica_losses=tuple(many.losses),
        tolerance=tolerance,
        causes=known_causes(reference, batch_norm=batch_norm),
        baseline_differences=baseline,
        baseline_losses=tuple(baseline_curve.losses),
    )


def nudged(x: Any) -> Any:
    """``x`` with each float element times ``1 + NUDGE`` or ``1 - NUDGE`` (a fixed pattern of signs), in
    its own dtype; other arrays as they are."""
    if is_batch_source(x) or is_map_dataset(x) or isinstance(x, Iterator):
        raise ValueError(
            f"rounding_baseline=True multiplies the inputs by 1 +- 2**-20, which needs x as arrays (a numpy array, "
            f"or a dict, list or tuple of them); got {type(x).__name__}. Pass the data as arrays, or leave "
            "rounding_baseline off."
        )
    floats = [leaf for leaf in flatten(x) if np.issubdtype(np.asarray(leaf).dtype, np.floating)]
    if not floats:
        raise ValueError(
            "rounding_baseline=True multiplies the float inputs by 1 +- 2**-20, but x holds no float arrays "
            "(integer ids stay as they are, so the baseline would measure nothing). Leave rounding_baseline off."
        )

    def nudge(array: Any) -> Any:
        array = np.asarray(array)
        if not np.issubdtype(array.dtype, np.floating):
            return array
        signs = np.random.default_rng(0).choice(np.array([-1.0, 1.0]), size=array.shape)
        return (array * (1.0 + signs * NUDGE)).astype(array.dtype)

    return map_structure(nudge, x)


def _trained(history: keras.callbacks.History) -> keras.Model:
    if history.model is None:
        raise RuntimeError("The trainer returned a History without its model; cannot compare the runs' weights.")
    return history.model


def _check_arguments(global_batch_size: int, steps: int, num_replicas: int, tolerance: float) -> None:
    """What can be wrong with the numbers, said before anything trains."""
    for name, value, least in (("steps", steps, 1), ("num_replicas", num_replicas, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}.")
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or not tolerance >= 0:
        raise ValueError(f"tolerance must be a number >= 0 (a relative weight difference), got {tolerance!r}.")
    padded_batch_size(global_batch_size, num_replicas)  # any size: the trainers pad a global batch that does not divide


def first_steps(x: Any, y: Any, *, global_batch_size: int, steps: int) -> tuple[Any, Any, int | None]:
    """``x`` and ``y`` cut to their first ``steps`` global batches (rows are read in order, both
    runs the same), or a batch source with ``steps_per_epoch=steps``. Both runs read the data,
    so it must be readable twice."""
    if isinstance(x, Iterator):
        raise ValueError(
            f"x is an iterator ({type(x).__name__}), which can be read once, but the check trains twice on the "
            "same batches. Pass arrays, a map-style dataset, a keras.utils.PyDataset or a DataLoader that yields "
            "the same batches each time it is read."
        )
    if is_batch_source(x):
        return x, y, steps
    rows = steps * global_batch_size
    if is_map_dataset(x):
        return (FirstItems(x, rows) if len(x) > rows else x), y, None
    return map_structure(lambda array: array[:rows], x), map_structure(lambda array: array[:rows], y), None


class FirstItems:
    """The first ``count`` items of a map-style dataset, itself one."""

    def __init__(self, dataset: Any, count: int) -> None:
        self.dataset, self.count = dataset, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Any:
        if not -self.count <= index < self.count:
            raise IndexError(f"index {index} out of range for the first {self.count} items")
        return self.dataset[index % self.count]


def starting_models(model: Any, x: Any, y: Any, count: int = 2) -> tuple[Any, ...]:
    """``count`` models for the runs, built, with the same weights and random-seed states: copies
    of a compiled model (``clone_model``, compiled like it; the caller's stays untouched), or
    for a factory, the model it builds and factories that build one more starting where it does."""
    rows = Rows(*(batch_source(x, y) if is_batch_source(x) else Inputs(x, y)).first_rows())
    if not isinstance(model, keras.Model):
        first = resolve_model(model)
        build_model(first, rows)
        more = StartingFrom(model, first.get_weights(), _seed_states(first), rows)
        return (first, *([more] * (count - 1)))
    resolve_model(model)  # a clear error for an uncompiled model, before cloning
    first, *more = (_compiled_copy(model) for _ in range(count))
    build_model(first, rows)
    if model.built:
        _start_like(first, model.get_weights(), _seed_states(model))
    for copy in more:
        build_model(copy, rows)
        _start_like(copy, first.get_weights(), _seed_states(first))
    return (first, *more)


class Rows:
    """A few rows ``(x, y, sample_weight)`` as numpy, to build a model from (``FirstRows``)."""

    def __init__(self, x: Any, y: Any = None, sample_weight: Any = None) -> None:
        self.rows = (x, y, sample_weight)

    def first_rows(self, count: int = 2) -> tuple[Any, Any, Any]:
        return self.rows


class StartingFrom:
    """A factory that builds the user's model and gives it these weights and seed states.
    Picklable when the user's factory is, so torch-dp's worker processes can call it."""

    def __init__(
        self, factory: Callable[[], keras.Model], weights: list[np.ndarray], seed_states: list[Any], rows: Rows
    ) -> None:
        self.factory, self.weights, self.seed_states, self.rows = factory, weights, seed_states, rows

    def __call__(self) -> keras.Model:
        model = resolve_model(self.factory)
        build_model(model, self.rows)  # a model without keras.Input has no weights to set yet
        _start_like(model, self.weights, self.seed_states)
        return model


def _compiled_copy(model: keras.Model) -> keras.Model:
    try:
        copy = keras.models.clone_model(model)
        compile_like(copy, cast("dict[str, Any]", model.get_compile_config()))
    except Exception as error:
        raise TypeError(
            f"Copying model '{model.name}' for the check failed (keras.models.clone_model and its compile config): "
            f"{type(error).__name__}: {error}. Pass a zero-argument function that builds and compiles the model "
            "instead."
        ) from error
    return copy


def _seed_states(model: keras.Model) -> list[np.ndarray]:
    return [generator.state.numpy() for generator in _seed_generators(model)]


def _seed_generators(model: keras.Model) -> list[Any]:
    layers = _internals.flatten_layers(model, include_self=True)
    return [generator for layer in layers for generator in _internals.seed_generators(layer)]


def _start_like(model: keras.Model, weights: list[np.ndarray], seed_states: list[np.ndarray]) -> None:
    """Same weights, and the same random-seed states (a copy's Dropout draws a fresh seed otherwise)."""
    model.set_weights(weights)
    for generator, state in zip(_seed_generators(model), seed_states, strict=True):
        generator.state.assign(state)


def layer_weights(model: keras.Model) -> list[tuple[str, list[np.ndarray]]]:
    """Each top-level layer's weights (trainable and not: BatchNormalization's moving statistics
    too), and the model's own weights that belong to no layer, by name."""
    named: list[tuple[str, list[np.ndarray]]] = []
    seen: set[int] = set()
    for layer in model.layers:
        if layer.weights:
            named.append((layer.name, layer.get_weights()))
            seen.update(id(w) for w in layer.weights)
    own = [w for w in model.weights if id(w) not in seen]
    if own:
        named.append((f"{model.name} (own weights)", [w.numpy() for w in own]))
    return named


def weight_differences(reference: keras.Model, other: keras.Model) -> dict[str, float]:
    """Per layer of ``reference`` (named as in it), the largest relative weight difference to
    the same layer of ``other``; layers are matched by position (a factory names them anew)."""
    mine, theirs = layer_weights(reference), layer_weights(other)
    if len(mine) != len(theirs):
        raise ValueError(f"The two runs' models differ: {len(mine)} layers with weights against {len(theirs)}.")
    return {name: relative_difference(a, b) for (name, a), (_, b) in zip(mine, theirs, strict=True)}


def _torch_generator_kept() -> Callable[[], None]:
    """What puts torch's own generators back as they are now: an unseeded Dropout draws from them on
    torch (Keras's fast path), so each run starts from the same state, as its seed generators do."""
    torch = sys.modules.get("torch")
    if torch is None:  # nothing drew from torch's generators
        return lambda: None
    cpu = torch.random.get_rng_state()
    devices = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def put_back() -> None:
        torch.random.set_rng_state(cpu)
        if devices is not None:
            torch.cuda.set_rng_state_all(devices)

    return put_back


def known_causes(model: keras.Model, *, batch_norm: BatchNormMode) -> tuple[str, ...]:
    """The ways ``model`` trained on N replicas differs from 1 replica by design (random layers are
    none: every replica draws the global batch's noise, as one device does)."""
    layers = _internals.flatten_layers(model)
    causes = []
    normalizing = [layer.name for layer in layers if isinstance(layer, keras.layers.BatchNormalization)]
    if normalizing and batch_norm == "per_replica":
        causes.append(
            f'batch_norm="per_replica": BatchNormalization layers ({_names(normalizing)}) normalize each '
            "replica's rows with that replica's statistics, not the global batch's (the default "
            'batch_norm="global" is exact)'
        )
    policies = sorted({layer.dtype_policy.name for layer in [model, *layers] if _low_precision(layer)})
    if policies:
        causes.append(
            f"mixed precision ({', '.join(policies)}): sums in {_low_dtypes(model, layers)} taken in a different "
            "order differ by that precision's rounding (about 1e-3 relative), far above float32's"
        )
    return tuple(causes)


def _low_precision(layer: keras.layers.Layer) -> bool:
    return str(layer.dtype_policy.compute_dtype) in LOW_PRECISION


def _low_dtypes(model: keras.Model, layers: Sequence[keras.layers.Layer]) -> str:
    dtypes = sorted({str(layer.dtype_policy.compute_dtype) for layer in [model, *layers] if _low_precision(layer)})
    return " and ".join(dtypes)


def _names(names: list[str], shown: int = 3) -> str:
    listed = ", ".join(names[:shown])
    return listed + (f" and {len(names) - shown} more" if len(names) > shown else "")


class LossCurve(keras.callbacks.Callback):
    """The loss logged after every training step (Keras's running mean over the epoch so far)."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
