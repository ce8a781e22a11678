"""``fit``/``evaluate``/``predict`` arguments, checked once for every backend before anything
starts (a process, a compile), so a mistake costs no start-up and reads the same everywhere.

The arguments mean what they mean in Keras; ``batch_size`` is the global batch, split over
the replicas (``global_batch_size`` is the same thing by its keras-dp name). Any global batch
is taken: one that does not divide over the replicas is padded up to a multiple, the padding
masked (``dp_core.padded_batch_size``), as a short last batch is.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from dp_core._checkpoint_format import check_checkpoint_arguments
from dp_core._data import map_structure
from dp_core._options import check_epochs, check_integer
from dp_core._split import EpochOrder, Shuffle, num_steps
from dp_core._trainer import Verbose
from dp_core.keras._executions import ONE_STEP, Executions
from dp_core.keras._inputs import Inputs, validation_inputs
from dp_core.keras._limits import leading_batches, limited_epochs, limited_steps
from dp_core.keras._losses import warn_added_losses_see_padding
from dp_core.keras._model import require_backend, require_keras_steps, resolve_model
from dp_core.keras._padding import note_padding
from dp_core.keras._sources import BatchSource, is_batch_source

DEFAULT_BATCH_SIZE = 32  # as model.fit's, when neither batch_size nor global_batch_size is given


@dataclass(frozen=True)
class FitArguments:
    """``fit``'s arguments as a backend's loop reads them, checked.

    Plain data: it travels to worker processes (arrays too, unless a backend swaps them
    for handles with ``Inputs.map_arrays``).
    """

    inputs: Inputs | BatchSource
    global_batch_size: int  # 0 for a source: its first batch's row count
    epochs: int = 1
    initial_epoch: int = 0
    validation: Inputs | BatchSource | None = None
    validation_batch_size: int | None = None
    validation_freq: int | Sequence[int] = 1
    callbacks: Sequence[keras.callbacks.Callback] = ()
    shuffle: Shuffle = True
    seed: int = 0
    steps_per_epoch: int | None = None  # arrays only (a source keeps its own): epochs read on across passes
    executions: Executions = ONE_STEP  # ``steps_per_execution``: an epoch reads whole groups
    checkpoint_dir: str | None = None
    checkpoint_every_steps: int | None = None
    checkpoint_in_background: bool = True
    verbose: Verbose = "auto"

    def epoch_order(self, epoch: int) -> EpochOrder:
        """Which rows epoch ``epoch`` of an array input reads, in which order (a source reads its
        ``epoch``, ``seed`` and ``shuffles_batches``)."""
        return EpochOrder(
            self.global_batch_size,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=epoch,
            first_epoch=self.initial_epoch,
            steps_per_epoch=self.executions.rounded(self.steps_per_epoch),
        )

    def steps_in(self, epoch: int) -> int | None:
        """The steps epoch ``epoch`` runs (``EpochOrder.steps``; a source's own count, None if it
        does not say; a backend's stand-in for a source says its ``num_batches`` too)."""
        if not isinstance(self.inputs, Inputs):
            return self.inputs.num_batches
        return self.epoch_order(epoch).steps(self.inputs.num_samples)

    @property
    def steps_shown(self) -> int | None:
        """The steps an epoch has in the progress bar and ``History.params``: ``steps_per_epoch``
        when given, as in ``model.fit`` (an epoch cut short at a pass end shows it too)."""
        return self.steps_per_epoch or self.steps_in(self.initial_epoch)

    def validates_after(self, epoch: int) -> bool:
        """Whether validation runs at the end of ``epoch`` (from 0), as Keras's ``validation_freq`` says."""
        if self.validation is None:
            return False
        if isinstance(self.validation_freq, int):
            return (epoch + 1) % self.validation_freq == 0
        return epoch + 1 in self.validation_freq

    @property
    def validation_global_batch_size(self) -> int:
        """``validation_batch_size``, else ``batch_size``, as Keras; a source's own batches."""
        if isinstance(self.validation, BatchSource):
            return self.validation.global_batch_size
        return self.validation_batch_size or self.global_batch_size


def global_batch_size_of(batch_size: Any, global_batch_size: Any, x: Any = None) -> int:
    """One global batch size from Keras's ``batch_size`` and keras-dp's ``global_batch_size``
    (either names it; neither: 32, as ``model.fit``). For a batch-yielding ``x`` the batches
    are the global batches, so neither may be given (as Keras refuses ``batch_size`` there);
    0 stands for "the first batch's row count"."""
    if is_batch_source(x):
        given = batch_size if batch_size is not None else global_batch_size
        if given is not None:
            raise ValueError(
                f"batch_size={given!r} was passed, but x is a {type(x).__name__}, which yields its own batches: each "
                "one is a global batch, split over the replicas. Drop batch_size (make the source yield batches of "
                "the size you want)."
            )
        return 0
    if batch_size is not None and global_batch_size is not None and batch_size != global_batch_size:
        raise ValueError(
            f"batch_size={batch_size!r} and global_batch_size={global_batch_size!r} name the same thing (the global "
            "batch, split over the replicas) but differ; pass one of them."
        )
    if batch_size is not None:
        return check_integer("batch_size", batch_size, minimum=1)
    if global_batch_size is not None:
        return check_integer("global_batch_size", global_batch_size, minimum=1)
    return DEFAULT_BATCH_SIZE


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
    class_weight: Mapping[int, float] | None = None,
    steps: int | None = None,
    steps_name: str = "steps",
    keras_steps: tuple[str, ...] = (),
) -> tuple[keras.Model, Inputs | BatchSource]:
    """The Keras model (a factory called) and the inputs, after every check that needs no
    device: the Keras backend, a compiled model (``compiled=False`` for ``predict``), none of
    the Keras steps the call runs (``keras_steps``) overridden, inputs that agree on their row
    count; a note when a global batch that does not divide over the replicas wastes much on padding."""
    require_backend(backend, package)
    keras_model = resolve_model(model, compiled=compiled)
    require_keras_steps(keras_model, keras_steps, package)
    inputs = checked_inputs(
        x,
        y,
        sample_weight,
        class_weight=class_weight,
        steps=steps,
        steps_name=steps_name,
    )
    if compiled and isinstance(inputs, Inputs):
        warn_added_losses_see_padding(keras_model, inputs, num_samples=inputs.num_samples, batch_size=global_batch_size)
    if isinstance(inputs, Inputs):
        note_padding(keras_model, global_batch_size, num_replicas, training=compiled)
    return keras_model, inputs


def checked_inputs(
    x: Any,
    y: Any,
    sample_weight: Any,
    *,
    class_weight: Mapping[int, float] | None,
    steps: int | None,
    steps_name: str,
) -> Inputs | BatchSource:
    """A batch source, or arrays that take no ``steps`` (a pass over every sample is the call), but
    ``fit``'s ``steps_per_epoch`` (``FitArguments.steps_per_epoch``). Any global batch: one that does
    not divide over the replicas is padded (``padded_batch_size``)."""
    if is_batch_source(x):
        # its batches need not divide over the replicas: each is padded up to a multiple (``padded_batch_size``)
        return batch_source(x, y, sample_weight, steps=steps, class_weight=class_weight)
    inputs = Inputs(x, y, sample_weight, class_weight=class_weight)
    if steps_name == "steps_per_epoch" and steps is not None:
        check_integer("steps_per_epoch", steps, minimum=1)
    else:
        _check_no_steps(steps, steps_name)
    return inputs


def steps_batch_size(x: Any, y: Any, sample_weight: Any, steps: int) -> int:
    """The global batch of arrays given ``steps_per_epoch`` but no batch size, as Keras's array
    adapter takes it: ``ceil(rows / steps)``.

    >>> steps_batch_size(np.zeros((99, 2)), None, None, 2)
    50
    """
    steps = check_integer("steps_per_epoch", steps, minimum=1)
    return math.ceil(Inputs(x, y, sample_weight).num_samples / steps)


def batch_source(
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    *,
    steps: int | None = None,
    class_weight: Mapping[int, float] | None = None,
    name: str = "x",
    restarts: bool = False,
) -> BatchSource:
    """A batch-yielding ``x``, after Keras's checks: ``y`` and ``sample_weight`` come from its batches."""
    if y is not None or sample_weight is not None:
        raise ValueError(
            f"{name} is a {type(x).__name__}, which yields its own batches, so y and sample_weight must come from "
            "them, not as separate arguments: yield (x, y) or (x, y, sample_weight)."
        )
    return BatchSource(x, steps_per_epoch=steps, class_weight=class_weight, name=name, restarts=restarts)


def fit_arguments(
    inputs: Inputs | BatchSource,
    *,
    global_batch_size: int,
    num_replicas: int,
    epochs: Any,
    verbose: Verbose = "auto",
    callbacks: Sequence[keras.callbacks.Callback] | None = None,
    validation_split: float = 0.0,
    validation_data: Any = None,
    shuffle: Shuffle = True,
    initial_epoch: Any = 0,
    steps_per_epoch: int | None = None,
    validation_steps: int | None = None,
    validation_batch_size: int | None = None,
    validation_freq: Any = 1,
    seed: int = 0,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every_steps: int | None = None,
    checkpoint_in_background: bool = True,
    executions: Executions = ONE_STEP,
) -> FitArguments:
    """``fit``'s arguments checked, after ``checked_model_and_inputs`` (in ``model.fit``'s order, then
    keras-dp's own). ``steps_per_epoch`` is kept for arrays (a source counts its own);
    ``shuffle="batch"`` shuffles an array input's rows within each batch (``dp_core.epoch_order``),
    and a source's batch order as ``True`` does, as Keras's adapters read it. With ``executions``
    (``model.steps_per_execution``) an epoch of ``steps_per_epoch`` reads whole groups, as Keras."""
    check_checkpoint_arguments(checkpoint_dir, checkpoint_every_steps, checkpoint_in_background)
    epochs = limited_epochs(check_epochs(epochs))  # keras.config.set_max_epochs, as model.fit
    initial_epoch = check_integer("initial_epoch", initial_epoch, minimum=0)
    seed = check_integer("seed", seed, minimum=0)
    shuffle = _checked_shuffle(shuffle, inputs)
    if isinstance(inputs, BatchSource):
        steps_per_epoch = None
    elif steps_per_epoch is not None:
        steps_per_epoch = check_integer("steps_per_epoch", steps_per_epoch, minimum=1)
    if isinstance(inputs, Inputs):  # checked_call said the step limit
        steps_per_epoch = limited_steps(steps_per_epoch, warn=False)
    inputs, validation = _checked_validation(
        inputs, validation_data, validation_split, validation_steps, validation_batch_size, executions
    )
    if isinstance(validation, Inputs) and (limit := limited_steps(None)) is not None:
        size = validation_batch_size or global_batch_size  # Keras's validation, cut to its limit's batches
        validation = leading_batches(validation, steps=executions.rounded(limit), global_batch_size=size)
    if steps_per_epoch is not None and isinstance(inputs, Inputs):  # the rows left to train on
        _warn_epochs_cut_short(inputs.num_samples, global_batch_size, executions.rounded(steps_per_epoch))
    return FitArguments(
        inputs,
        global_batch_size,
        epochs=epochs,
        initial_epoch=initial_epoch,
        validation=validation,
        validation_batch_size=validation_batch_size,
        validation_freq=_check_validation_freq(validation_freq),
        callbacks=list(callbacks or []),
        shuffle=shuffle,
        seed=seed,
        checkpoint_dir=None if checkpoint_dir is None else os.fspath(checkpoint_dir),
        checkpoint_every_steps=checkpoint_every_steps,
        checkpoint_in_background=checkpoint_in_background,
        verbose=verbose,
        steps_per_epoch=steps_per_epoch,
        executions=executions,
    )


def _checked_validation(
    inputs: Inputs | BatchSource,
    validation_data: Any,
    validation_split: float,
    validation_steps: int | None,
    validation_batch_size: int | None,
    executions: Executions,
) -> tuple[Inputs | BatchSource, Inputs | BatchSource | None]:
    """The inputs left to train on and the validation inputs: ``validation_data``, or the last rows
    of arrays (``validation_split``), as Keras takes them (a source's ``validation_steps`` under
    Keras's step limit, in whole groups)."""
    validation: Inputs | BatchSource | None = None
    if is_batch_source(validation_data):
        steps = executions.rounded(limited_steps(validation_steps))
        validation = batch_source(validation_data, steps=steps, name="validation_data", restarts=True)
    elif validation_data is not None:
        validation = validation_inputs(validation_data)
        _check_no_steps(validation_steps, "validation_steps")
    if validation_batch_size is not None:  # any size: padded up to a multiple of the replicas, as batch_size
        check_integer("validation_batch_size", validation_batch_size, minimum=1)
    if validation is None and validation_split:
        if isinstance(inputs, BatchSource):
            raise ValueError(
                f"validation_split is only supported for arrays (as in Keras), but x is a "
                f"{type(inputs.source).__name__}. Pass validation_data=... instead."
            )
        inputs, validation = _split_off_validation(inputs, validation_split)
    return inputs, validation


def _checked_shuffle(shuffle: Any, inputs: Inputs | BatchSource) -> Shuffle:
    if isinstance(shuffle, str) and shuffle == "batch":
        return True if isinstance(inputs, BatchSource) else "batch"
    if not isinstance(shuffle, (bool, np.bool_)):
        raise ValueError(f'shuffle must be True, False or "batch", got {shuffle!r}.')
    return bool(shuffle)


def _warn_epochs_cut_short(num_samples: int, global_batch_size: int, steps_per_epoch: int) -> None:
    """Keras's ``EpochIterator`` ends an epoch where a pass over the arrays ends, warning that the
    input ran out (``dp_core.epoch_rows``): said once here, with what it means."""
    batches = num_steps(num_samples, global_batch_size)
    if batches % steps_per_epoch == 0:
        return
    if steps_per_epoch > batches:
        what = f"so, as in model.fit, every epoch stops at the end of its pass, after {batches} steps"
    else:
        short = batches % steps_per_epoch
        what = (
            f"so, as in model.fit, the epoch that reaches the end of a pass stops there, after {short} steps, and "
            "the next epoch starts a new pass"
        )
    warnings.warn(
        f"steps_per_epoch={steps_per_epoch}, but one pass over the {num_samples} rows is {batches} "
        f"{'batch' if batches == 1 else 'batches'} of "
        f"{global_batch_size}, {what}. Pass a steps_per_epoch that divides {batches} to make every epoch "
        f"{steps_per_epoch if steps_per_epoch < batches else 'as long as you asked'}.",
        UserWarning,
        stacklevel=3,
    )


def _split_off_validation(inputs: Inputs, validation_split: float) -> tuple[Inputs, Inputs]:
    """Keras's ``validation_split``: the last fraction of the rows, before any shuffling."""
    if not 0.0 < validation_split < 1.0:
        raise ValueError(f"validation_split must be a float between 0 and 1, got {validation_split!r}.")
    if inputs.is_dataset:
        raise ValueError(
            f"validation_split is only supported for arrays (as in Keras), but x is a dataset "
            f"({type(inputs.x).__name__}). Pass validation_data=... instead."
        )
    split_at = math.floor(inputs.num_samples * (1.0 - validation_split))
    if split_at in (0, inputs.num_samples):
        raise ValueError(
            f"The training data has {inputs.num_samples} samples, which is not enough to split with "
            f"validation_split={validation_split}: one part would be empty. Use more data or another split."
        )

    def part(rows: slice) -> Inputs:
        # basic slicing: a view, so a memory-mapped array stays mapped
        x, y, sample_weight = (map_structure(lambda a: a[rows], p) for p in (inputs.x, inputs.y, inputs.sample_weight))
        return Inputs(x, y, sample_weight, class_weight=inputs.class_weight)

    validation = part(slice(split_at, None))
    validation = Inputs(validation.x, validation.y, validation.sample_weight)  # class_weight is for training only
    return part(slice(0, split_at)), validation


def _check_validation_freq(validation_freq: Any) -> int | list[int]:
    if isinstance(validation_freq, bool) or not isinstance(validation_freq, (int, list, tuple)):
        raise ValueError(
            f"validation_freq must be an int (validate every that many epochs) or a list of epochs (from 1), "
            f"got {validation_freq!r}."
        )
    if isinstance(validation_freq, int):
        if validation_freq < 1:
            raise ValueError(f"validation_freq must be >= 1, got {validation_freq}.")
        return validation_freq
    return [int(epoch) for epoch in validation_freq]


def _check_no_steps(steps: Any, name: str) -> None:
    if steps is None:
        return
    raise ValueError(
        f"{name}={steps!r}: with arrays or a map-style dataset this call reads every sample once, so {name} is "
        "not taken (only fit's steps_per_epoch is). Pass fewer rows (x[:n]) to use part of the data."
    )
