"""Keras's debugging limits, ``keras.config.set_max_epochs(n)`` and ``set_max_steps_per_epoch(n)``
(or the ``KERAS_MAX_EPOCHS`` and ``KERAS_MAX_STEPS_PER_EPOCH`` variables), honored where and as
``model.fit``/``evaluate``/``predict`` honor them (Keras 3.10 to 3.16 read them the same way):

- a fit runs at most ``max_epochs`` epochs ("Limiting epochs to n");
- every epoch iterator (a fit's epochs, its validation, an ``evaluate``, a ``predict``) reads at most
  ``max_steps_per_epoch`` steps, given ``steps`` or not ("Limiting steps_per_epoch to n"). Keras caps
  the steps before its array adapter sees them, so arrays given no batch size are read in batches of
  ``ceil(rows / n)`` (every row), and arrays given one read their first ``n`` batches only: a fit's
  epochs read on where the last one stopped (``FitArguments.steps_per_epoch``), a validation, an
  ``evaluate`` or a ``predict`` reads its first rows (``leading_batches``).

One case reads otherwise: a fit given neither batch size nor ``validation_batch_size`` validates in
batches of its training batch (``ceil(rows / n)``), where Keras's validation takes ``ceil(validation
rows / n)``, so a validation set larger than the training set is cut to ``n`` such batches here
(``fit_arguments`` is not told whether the batch size was given).
"""

from __future__ import annotations

import warnings
from typing import Any

import keras

from dp_core._data import map_structure
from dp_core.keras._inputs import Inputs


def limited_epochs(epochs: int) -> int:
    """``epochs``, or ``keras.config.max_epochs()`` where that is set and smaller (warned, as Keras)."""
    limit = keras.config.max_epochs()
    if limit and limit < epochs:
        warnings.warn(f"Limiting epochs to {limit}", UserWarning, stacklevel=3)
        return limit
    return epochs


def limited_steps(steps: int | None, *, warn: bool = True) -> int | None:
    """An epoch's ``steps`` (None: as many as the data has), or ``keras.config.max_steps_per_epoch()``
    where that is set and smaller (warned, as Keras's ``EpochIterator``; ``warn=False`` where the same
    limit was already said for the same steps)."""
    limit = keras.config.max_steps_per_epoch()
    if limit and (not steps or limit < steps):
        if warn:
            warnings.warn(f"Limiting steps_per_epoch to {limit}", UserWarning, stacklevel=3)
        return limit
    return steps


def leading_batches(inputs: Inputs, *, steps: int, global_batch_size: int) -> Inputs:
    """The rows of the first ``steps`` global batches of ``inputs`` (all of them if there are not
    more): what an unshuffled pass of ``steps`` steps reads, as Keras's evaluation and prediction
    read arrays under a step limit.

    >>> import numpy as np
    >>> part = leading_batches(Inputs(np.arange(10), np.arange(10)), steps=2, global_batch_size=4)
    >>> part.num_samples, part.y.tolist()
    (8, [0, 1, 2, 3, 4, 5, 6, 7])
    """
    count = steps * global_batch_size
    if count >= inputs.num_samples:
        return inputs
    if inputs.is_dataset:
        return Inputs(LeadingItems(inputs.x, count), class_weight=inputs.class_weight)
    x, y, sample_weight = (
        map_structure(lambda leaf: leaf[:count], part) for part in (inputs.x, inputs.y, inputs.sample_weight)
    )
    return Inputs(x, y, sample_weight, class_weight=inputs.class_weight)


class LeadingItems:
    """A map-style dataset's first ``count`` items, itself a map-style dataset (it pickles with the dataset)."""

    def __init__(self, dataset: Any, count: int) -> None:
        self.dataset, self.count = dataset, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Any:
        if not -self.count <= index < self.count:
            raise IndexError(f"index {index} is out of range for the first {self.count} items")
        return self.dataset[index % self.count]
