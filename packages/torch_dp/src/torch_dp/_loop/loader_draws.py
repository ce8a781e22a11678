"""What Keras's torch data loader draws from torch's generator in ``model.fit``, ``evaluate`` and
``predict`` over arrays, drawn again on every replica at the same points (``KerasLoader``).

Keras's torch backend reads arrays through a ``torch.utils.data.DataLoader``
(``ArrayDataAdapter.get_torch_dataloader``). Starting to iterate one draws its workers' base seed
from torch's generator (one int64); until Keras 3.16, a shuffling ``RandomSampler`` draws a seed of
its own when its first batch is read (3.16's sampler seeds a generator of its own with the epoch).
Keras's ``EpochIterator`` starts an iteration at an epoch's start and again as soon as an epoch has
read every batch: two draws an epoch (three shuffled), two an evaluation or prediction; a ``fit`` or
``evaluate`` that must build the model first reads a batch of one more iteration
(``Trainer._symbolic_build``). An unseeded ``Dropout`` draws its masks from that same generator
(Keras's fast path), so its masks are ``model.fit``'s only when these draws come at the same points.

A batch source is read by rank 0 alone (``_data``), which draws what Keras's loader over it draws: a
``DataLoader``'s own iterations draw as they start (its workers' seed, a shuffling sampler's), and a
``PyDataset``, which Keras reads through a ``DataLoader`` over it made at each iteration (one draw as
it starts, at the points arrays' loader starts), draws here (``keras_loader``). The other replicas take
rank 0's generator with the batches it sends, before any step of theirs draws. Not drawn: Keras 3.15's
``shuffle="batch"``, a ``torch.randperm`` per batch (its order is not Keras's anyway), and a generator's
or other iterator's loader.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import keras
import torch

from dp_core import num_steps
from dp_core.keras import BatchSource, FitArguments, FitJob, Inputs, Job, internals
from torch_dp._data.sources import Readable

T = TypeVar("T")


def _draw() -> None:
    """One draw as a ``DataLoader`` iteration's start (and a ``RandomSampler``'s) takes it."""
    torch.empty((), dtype=torch.int64).random_()


@dataclass
class KerasLoader:
    """Keras's ``EpochIterator`` over ``num_batches`` batches of arrays, as torch's generator sees it:
    an iteration started (a draw) and, ``shuffle``d, its first batch read (another)."""

    num_batches: int
    steps_per_epoch: int | None = None
    steps_per_execution: int = 1
    shuffle: bool = False
    started: bool = False  # an iteration is open (kept across epochs with ``steps_per_epoch``)
    unread: bool = False  # the open iteration's sampler has not drawn its seed yet
    steps_seen: int = 0

    def builds(self) -> None:
        """``_symbolic_build`` reads one batch of an iteration of its own, which ``reset`` then drops."""
        self._start()
        self._first_batch()
        self.started = False

    def epoch_begins(self) -> None:
        """Before the epoch's first step: an iteration started (one per epoch without
        ``steps_per_epoch``; else the open one goes on) and its first batch read."""
        if not self.started or self.steps_per_epoch is None:
            self._start()
        self._first_batch()

    def epoch_ends(self) -> None:
        """After an epoch read to its end (not one stopped inside): Keras counts the groups it served
        and starts the next iteration at once when every batch was read."""
        for _ in range(0, self.steps_per_epoch or self.num_batches, self.steps_per_execution):
            if self.steps_seen >= self.num_batches:
                break
            self.steps_seen += self.steps_per_execution
        if self.steps_seen >= self.num_batches:
            self._start()

    def reading(self, batches: Iterable[T]) -> Iterator[T]:
        """``batches``, drawn as Keras's ``EpochIterator`` draws over them: as the first is asked for, and
        when asked for one after the last (a loop that stops early asks for none)."""
        self.epoch_begins()
        yield from batches
        self.epoch_ends()

    def _start(self) -> None:
        _draw()
        self.started, self.unread, self.steps_seen = True, self.shuffle, 0

    def _first_batch(self) -> None:
        if self.unread:
            _draw()
            self.unread = False


class NoDraws:
    """An input Keras does not read through an array ``DataLoader`` here: nothing to draw."""

    def builds(self) -> None:
        pass

    def epoch_begins(self) -> None:
        pass

    def epoch_ends(self) -> None:
        pass

    def reading(self, batches: Iterable[T]) -> Iterable[T]:
        return batches


NO_DRAWS = NoDraws()


def keras_loader(
    inputs: Readable,
    global_batch_size: int,
    *,
    shuffle: bool | str = False,
    steps_per_epoch: int | None = None,
    steps_per_execution: int = 1,
) -> KerasLoader | NoDraws:
    """The draws of Keras's loader over ``inputs``: arrays (``shuffle="batch"`` draws as unshuffled), or
    a ``PyDataset`` on the replica that reads it (its own shuffling is numpy's: no draw of torch's)."""
    if isinstance(inputs, BatchSource) and inputs.is_py_dataset and inputs.source.num_batches is not None:
        batches = inputs.source.num_batches
        return KerasLoader(batches, steps_per_epoch=steps_per_epoch, steps_per_execution=steps_per_execution)
    if not isinstance(inputs, Inputs) or global_batch_size <= 0:
        return NO_DRAWS
    return KerasLoader(
        num_steps(inputs.num_samples, global_batch_size),
        steps_per_epoch=steps_per_epoch,
        steps_per_execution=steps_per_execution,
        shuffle=shuffle is True and _shuffling_draws(),
    )


def _shuffling_draws() -> bool:
    """Whether Keras's shuffling sampler seeds itself from torch's generator: a ``RandomSampler`` until
    Keras 3.16, whose sampler seeds a generator of its own with the epoch."""
    major, minor = (int(part) for part in keras.version().split(".")[:2])
    return (major, minor) < (3, 16)


def fit_loader(arguments: FitArguments) -> KerasLoader | NoDraws:
    """The draws of Keras's torch loader over a fit's input (its shuffling, ``steps_per_epoch`` and
    ``steps_per_execution``)."""
    return keras_loader(
        arguments.inputs,
        arguments.global_batch_size,
        shuffle=arguments.shuffle,
        steps_per_epoch=arguments.steps_per_epoch,
        steps_per_execution=arguments.executions.size,
    )


def job_loader(job: Job) -> KerasLoader | NoDraws:
    """The draws of Keras's torch loader over ``job``'s input, as ``model.fit``, ``evaluate`` or
    ``predict`` reads it."""
    if isinstance(job, FitJob):
        return fit_loader(job.arguments)
    return keras_loader(job.inputs, job.global_batch_size, steps_per_execution=job.executions.size)


def build_drawing(model: keras.Model, build: Callable[[], None], loader: KerasLoader | NoDraws) -> None:
    """``build()`` the model, drawing what Keras's ``loader`` draws to build it from a batch where
    ``model.fit`` or ``evaluate`` would (its layers, compiled loss or metrics not built yet)."""
    keras_builds = internals.builds_from_a_batch(model)
    build()
    if keras_builds:
        loader.builds()
