"""The checks every ``fit``, ``evaluate`` and ``predict`` of a trainer makes before anything
starts, written once: ``checked_call``.

A backend passes what differs between backends: its Keras backend and package name, the
Keras steps the call runs, and what it asks of a model that overrides one of them (its own
``check_own_steps``). Each check raises the same error, with the same message, whichever
backend calls it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import keras

from dp_core.keras._arguments import checked_inputs, global_batch_size_of, steps_batch_size
from dp_core.keras._batch_terms import check_batch_metrics, warn_terms_not_split
from dp_core.keras._inputs import Inputs
from dp_core.keras._model import overrides, require_backend, require_keras_steps, resolve_model
from dp_core.keras._sources import BatchSource, is_batch_source


class OwnStepsCheck(Protocol):
    """A backend's errors for a model that overrides ``step_names`` (the ones the call runs and
    the model defines itself); ``compiled`` when the call needs ``model.compile``."""

    def __call__(self, model: keras.Model, step_names: tuple[str, ...], *, compiled: bool) -> None: ...


class CheckedCall(NamedTuple):
    """What a call works on once every check passed: the Keras model (a factory's, called
    once), the inputs, and the global batch size (a batch source's own)."""

    model: keras.Model
    inputs: Inputs | BatchSource
    global_batch_size: int


def checked_call(
    model: Any,
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    *,
    batch_size: Any,
    global_batch_size: Any,
    backend: str,
    package: str,
    num_replicas: int,
    step_names: tuple[str, ...],
    compiled: bool = True,
    check_own_steps: OwnStepsCheck | None = None,
    splits_batch_terms: bool = False,
    class_weight: Mapping[int, float] | None = None,
    steps: int | None = None,
    steps_name: str = "steps",
) -> CheckedCall:
    """Every check of a call that needs no device, in this order, so the first mistake is the
    one reported:

    1. one global batch size from ``batch_size`` and ``global_batch_size`` (``global_batch_size_of``);
    2. Keras runs on ``backend`` (``require_backend``, naming ``package``);
    3. a zero-argument factory is called (once);
    4. the steps of ``step_names`` the model overrides: ``check_own_steps`` gets them (with
       ``compiled``); without one, an override is an error (``require_keras_steps``);
    5. a ``keras.Model`` (``resolve_model``) and, when ``compiled`` (not for ``predict``) and a
       Keras step of ``step_names`` runs, one compiled with a loss (``require_compiled``);
       then, for array inputs, no compiled metric of one value per batch (``check_batch_metrics``)
       and, with ``splits_batch_terms`` (the backend computes a batch's terms on each replica's
       rows), a warning for an ``add_loss`` or ``compute_loss`` term that is not a mean over rows
       (``warn_terms_not_split``). (A short last batch runs whole where the model has such terms:
       ``runs_last_batch_whole``.)
    6. the inputs: a batch source (``steps`` its batches per epoch), or arrays whose global
       batch divides over ``num_replicas`` and that take no ``steps`` (named ``steps_name``)
       but ``fit``'s ``steps_per_epoch`` (without a batch size, the batch is then Keras's
       ``ceil(rows / steps_per_epoch)``).

    A batch source's batches are the global batches: its ``global_batch_size`` is returned (see ``_source_call``).

    >>> import numpy as np
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> call = checked_call(model, np.zeros((8, 3)), np.zeros((8, 1)), batch_size=4, global_batch_size=None,
    ...                     backend=keras.backend.backend(), package="a_dp", num_replicas=2, step_names=("train_step",))
    >>> call.model is model, call.inputs.num_samples, call.global_batch_size
    (True, 8, 4)
    """
    size = global_batch_size_of(batch_size, global_batch_size, x)
    unsized = batch_size is None and global_batch_size is None
    if steps is not None and steps_name == "steps_per_epoch" and unsized and not is_batch_source(x):
        size = steps_batch_size(x, y, sample_weight, steps)  # Keras's array adapter: ceil(rows / steps)
    require_backend(backend, package)
    if not isinstance(model, keras.Model) and callable(model):
        model = model()  # a factory is called once, here
    own = tuple(name for name in step_names if isinstance(model, keras.Model) and overrides(model, name))
    if own and check_own_steps is None:
        require_keras_steps(model, own, package)
    elif own and check_own_steps is not None:
        check_own_steps(model, own, compiled=compiled)
    keras_step_runs = compiled and len(own) < len(step_names)
    keras_model = resolve_model(model, compiled=keras_step_runs)  # not a model: a TypeError
    inputs = checked_inputs(
        x,
        y,
        sample_weight,
        global_batch_size=size,
        num_replicas=num_replicas,
        class_weight=class_weight,
        steps=steps,
        steps_name=steps_name,
    )
    if isinstance(inputs, BatchSource):
        return _source_call(keras_model, inputs, starts=compiled)
    if keras_step_runs and (num_replicas > 1 or inputs.num_samples % size):
        check_batch_metrics(keras_model, inputs)
    if keras_step_runs and splits_batch_terms:
        warn_terms_not_split(keras_model, inputs, num_replicas=num_replicas, package=package)
    return CheckedCall(keras_model, inputs, size)


def _source_call(model: keras.Model, source: BatchSource, *, starts: bool) -> CheckedCall:
    """A batch source's call, its batches the global batches. ``fit`` and ``evaluate`` (``starts``)
    start it where ``model.fit`` does: by reading a batch to build an unbuilt model."""
    size = source.global_batch_size  # its first batch, read with the source's draws left as they were
    if starts:
        source.starts_as_keras(model)
    return CheckedCall(model, source, size)
