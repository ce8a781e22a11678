"""``fit``/``evaluate``/``predict`` arguments, checked once for every backend before anything
starts (a process, a compile), so a mistake costs no start-up and reads the same everywhere."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import keras

from dp_core._batch import per_replica_batch_size
from dp_core._checkpoint import check_checkpoint_arguments
from dp_core._lr import LearningRateScaling
from dp_core._options import check_epochs
from dp_core._trainer import Verbose
from dp_core.keras._inputs import Inputs, validation_inputs
from dp_core.keras._model import require_backend, resolve_model


@dataclass(frozen=True)
class FitArguments:
    """``fit``'s arguments as a backend's loop reads them, checked.

    Plain data: it travels to worker processes (arrays too, unless a backend swaps them
    for handles with ``Inputs.map_arrays``).
    """

    inputs: Inputs
    global_batch_size: int
    epochs: int = 1
    validation: Inputs | None = None
    callbacks: Sequence[keras.callbacks.Callback] = ()
    shuffle: bool = True
    seed: int = 0
    lr_scaling: LearningRateScaling | None = None
    warmup_steps: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every_steps: int | None = None
    verbose: Verbose = "auto"


def checked_model_and_inputs(
    model: Any,
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    *,
    backend: str,
    package: str,
    global_batch_size: int,
    num_replicas: int,
    compiled: bool = True,
) -> tuple[keras.Model, Inputs]:
    """The Keras model (a factory called) and the inputs, after every check that needs no
    device: the Keras backend, a compiled model (``compiled=False`` for ``predict``), a
    global batch that divides over the replicas, inputs that agree on their row count."""
    require_backend(backend, package)
    keras_model = resolve_model(model, compiled=compiled)
    per_replica_batch_size(global_batch_size, num_replicas)
    return keras_model, Inputs(x, y, sample_weight)


def fit_arguments(
    inputs: Inputs,
    *,
    global_batch_size: int,
    epochs: Any,
    validation_data: Any,
    callbacks: Sequence[keras.callbacks.Callback] | None,
    shuffle: bool,
    seed: int,
    lr_scaling: LearningRateScaling | None,
    warmup_steps: int,
    checkpoint_dir: str | os.PathLike[str] | None,
    checkpoint_every_steps: int | None,
    verbose: Verbose,
) -> FitArguments:
    """``fit``'s arguments checked, after ``checked_model_and_inputs``."""
    check_checkpoint_arguments(checkpoint_dir, checkpoint_every_steps)
    return FitArguments(
        inputs,
        global_batch_size,
        epochs=check_epochs(epochs),
        validation=None if validation_data is None else validation_inputs(validation_data),
        callbacks=list(callbacks or []),
        shuffle=shuffle,
        seed=seed,
        lr_scaling=lr_scaling,
        warmup_steps=warmup_steps,
        checkpoint_dir=None if checkpoint_dir is None else os.fspath(checkpoint_dir),
        checkpoint_every_steps=checkpoint_every_steps,
        verbose=verbose,
    )
