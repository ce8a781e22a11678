"""The checks every ``fit``, ``evaluate`` and ``predict`` of a trainer makes before anything
starts, written once: ``checked_call``.

A backend passes what differs between backends, once per trainer (``CallChecks``: its Keras
backend and package name, its replicas, what it asks of a model that overrides a step the call
runs), and per call the Keras steps the call runs. Each check raises the same error, with the
same message, whichever backend calls it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import keras

from dp_core.keras._arguments import checked_inputs, global_batch_size_of, steps_batch_size
from dp_core.keras._batch_terms import check_batch_metrics, warn_terms_not_split
from dp_core.keras._distribution import require_no_keras_distribution
from dp_core.keras._executions import ONE_STEP, Executions
from dp_core.keras._inputs import Inputs
from dp_core.keras._limits import leading_batches, limited_steps
from dp_core.keras._model import (
    is_factory,
    is_trainable_model,
    note_step_compilation,
    overrides,
    require_backend,
    require_keras_steps,
    resolve_model,
)
from dp_core.keras._padding import note_padding
from dp_core.keras._sources import BatchSource, is_batch_source


class OwnStepsCheck(Protocol):
    """A backend's errors for a model that overrides ``step_names`` (the ones the call runs and
    the model defines itself); ``compiled`` when the call needs ``model.compile``."""

    def __call__(self, model: keras.Model, step_names: tuple[str, ...], *, compiled: bool) -> None: ...


class CheckedCall(NamedTuple):
    """What a call works on once every check passed: the Keras model (a factory's, called
    once), the inputs, the global batch size (a batch source's own), and the model's
    ``steps_per_execution``."""

    model: keras.Model
    inputs: Inputs | BatchSource
    global_batch_size: int
    executions: Executions = ONE_STEP


@dataclass(frozen=True)
class CallChecks:
    """What a backend asks of ``checked_call``, the same at every call of one trainer."""

    backend: str  # the Keras backend its calls run on
    package: str  # the backend's package, named in the errors
    num_replicas: int
    # the backend's errors for a model's own steps; None: a model may not override a step the call runs
    check_own_steps: OwnStepsCheck | None = None
    # each replica computes a batch's ``add_loss`` and ``compute_loss`` terms on its own rows
    splits_batch_terms: bool = False

    def own_steps(self, model: Any, step_names: tuple[str, ...], *, compiled: bool) -> tuple[str, ...]:
        """The steps of ``step_names`` that ``model`` (if a ``keras.Model``) overrides, once the
        backend's ``check_own_steps`` accepted them (``compiled``: the call needs ``model.compile``);
        without one, an override is an error (``require_keras_steps``)."""
        own = tuple(name for name in step_names if is_trainable_model(model) and overrides(model, name))
        if own and self.check_own_steps is None:
            require_keras_steps(model, own, self.package)
        elif own and self.check_own_steps is not None:
            self.check_own_steps(model, own, compiled=compiled)
        return own

    def check_split_batches(self, model: keras.Model, inputs: Inputs, global_batch_size: int) -> None:
        """For arrays a Keras step runs on: no compiled metric of one value per batch where a batch
        is split or the last one short (``check_batch_metrics``); where the backend splits a batch's
        terms, a warning for an ``add_loss`` or ``compute_loss`` term that is not a mean over rows
        (``warn_terms_not_split``; a short last batch then runs whole: ``runs_last_batch_whole``)."""
        if self.num_replicas > 1 or inputs.num_samples % global_batch_size:
            check_batch_metrics(model, inputs)
        if self.splits_batch_terms:
            warn_terms_not_split(model, inputs, num_replicas=self.num_replicas, package=self.package)


def checked_call(
    model: Any,
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    *,
    batch_size: Any,
    global_batch_size: Any,
    checks: CallChecks,
    step_names: tuple[str, ...],
    compiled: bool = True,
    class_weight: Mapping[int, float] | None = None,
    steps: int | None = None,
    steps_name: str = "steps",
) -> CheckedCall:
    """Every check of a call that needs no device, in this order, so the first mistake is the
    one reported:

    1. one global batch size from ``batch_size`` and ``global_batch_size`` (``global_batch_size_of``;
       with neither, for arrays, ``fit``'s ``steps_per_epoch`` gives Keras's ``ceil(rows / steps)``),
       and ``steps`` capped by ``keras.config.set_max_steps_per_epoch`` (``_size_and_steps``);
    2. Keras runs on ``checks.backend`` (``require_backend``, naming ``checks.package``);
    3. a zero-argument factory is called (once);
    4. the steps of ``step_names`` the model overrides (``CallChecks.own_steps``);
    5. a ``keras.Model`` (``resolve_model``), compiled when ``compiled`` (not for ``predict``) and
       a Keras step of ``step_names`` runs (with ``loss=`` or without: ``add_loss`` terms, as Keras);
       no Keras distribution set (``require_no_keras_distribution``); a warning when the model is compiled
       to run its step in a way the trainer does not take (``note_step_compilation``);
    6. the inputs (``checked_inputs``): a batch source (``steps`` its batches per epoch, each a
       global batch: its ``global_batch_size`` is returned), or arrays that take no ``steps``
       (named ``steps_name``) but ``steps_per_epoch``, of any global batch (padded up to a
       multiple of the replicas; ``note_padding`` warns when that wastes much, after step 8);
    7. under that step limit, an evaluation's arrays cut to the batches it reads (``leading_batches``);
    8. for arrays a Keras step runs on, its metrics and batch terms (``CallChecks.check_split_batches``).

    >>> import numpy as np
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> checks = CallChecks(backend=keras.backend.backend(), package="a_dp", num_replicas=2)
    >>> call = checked_call(model, np.zeros((8, 3)), np.zeros((8, 1)), batch_size=4, global_batch_size=None,
    ...                     checks=checks, step_names=("train_step",))
    >>> call.model is model, call.inputs.num_samples, call.global_batch_size
    (True, 8, 4)
    """
    size, limited = _size_and_steps(x, y, sample_weight, batch_size, global_batch_size, steps, steps_name)
    require_backend(checks.backend, checks.package)
    if is_factory(model):
        model = model()  # a factory is called once, here
    own = checks.own_steps(model, step_names, compiled=compiled)
    keras_step_runs = compiled and len(own) < len(step_names)
    keras_model = resolve_model(model, compiled=keras_step_runs)  # not a model: a TypeError
    require_no_keras_distribution(keras_model, checks.package)
    note_step_compilation(keras_model, checks.backend, checks.package, step_runs=keras_step_runs)
    executions = Executions.of(keras_model)
    inputs = checked_inputs(
        x,
        y,
        sample_weight,
        class_weight=class_weight,
        steps=executions.rounded(limited) if is_batch_source(x) else steps,  # a source: whole groups, as Keras
        steps_name=steps_name,
    )
    if isinstance(inputs, BatchSource):
        return _source_call(keras_model, inputs, executions, starts=compiled)
    if limited is not None and steps_name != "steps_per_epoch":  # Keras's step limit on an evaluation's arrays
        inputs = leading_batches(inputs, steps=executions.rounded(limited), global_batch_size=size)
    if keras_step_runs:
        checks.check_split_batches(keras_model, inputs, size)
    note_padding(keras_model, size, checks.num_replicas, training=keras_step_runs and "train_step" in step_names)
    return CheckedCall(keras_model, inputs, size, executions)


def _size_and_steps(
    x: Any, y: Any, sample_weight: Any, batch_size: Any, global_batch_size: Any, steps: int | None, steps_name: str
) -> tuple[int, int | None]:
    """The call's global batch size and steps as Keras's ``EpochIterator`` takes them: ``steps``
    capped by ``keras.config.max_steps_per_epoch()`` (``limited_steps``), and arrays given no batch
    size but a step count (``fit``'s ``steps_per_epoch``, or that limit) read in Keras's array
    adapter's ``ceil(rows / steps)``."""
    size = global_batch_size_of(batch_size, global_batch_size, x)
    limited = limited_steps(steps)
    unsized = batch_size is None and global_batch_size is None
    counted = steps_name == "steps_per_epoch" or limited != steps  # an evaluation's own steps are refused
    if limited is not None and counted and unsized and not is_batch_source(x):
        size = steps_batch_size(x, y, sample_weight, limited)
    return size, limited


def _source_call(model: keras.Model, source: BatchSource, executions: Executions, *, starts: bool) -> CheckedCall:
    """A batch source's call, its batches the global batches. ``fit`` and ``evaluate`` (``starts``)
    start it where ``model.fit`` does: by reading a batch to build an unbuilt model."""
    size = source.global_batch_size  # its first batch, read with the source's draws left as they were
    if starts:
        source.starts_as_keras(model)
    return CheckedCall(model, source, size, executions)
