"""What the replicas run for one call: a ``FitJob``, an ``EvaluateJob`` or a ``PredictJob``.

Each job is plain data that can travel to a worker replica (its arrays as memory-mapped
files, see ``_batches``; its callbacks stay with the caller, rank 0, which alone runs
them); ``_run.run_job`` runs one on a replica and returns that replica's result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import keras

from dp_core import BatchNormMode, NonFiniteLoss, Verbose
from dp_core.keras import BatchSource, FitArguments, Inputs, LearningRatePolicy
from torch_dp._batches import Readable, SourceOnPrimary, open_shared


@dataclass(frozen=True)
class FitJob:
    """``fit``'s checked arguments and the trainer's options (run: ``_run.run_fit``, this replica's History)."""

    arguments: FitArguments
    batch_norm: BatchNormMode
    log_every_steps: int
    on_nonfinite_loss: NonFiniteLoss
    lr_policy: LearningRatePolicy | None
    resume_from: str | None  # the checkpoint the caller chose and checked
    profile: str | None = None  # the scaling report's folder (``Trainer(profile=...)``)

    @property
    def inputs(self) -> Readable:
        return self.arguments.inputs

    @property
    def validation(self) -> Readable | None:
        return self.arguments.validation


@dataclass(frozen=True)
class EvaluateJob:
    """``evaluate``'s arguments (run: ``_run.run_evaluate``, the logs over every replica's rows)."""

    inputs: Readable
    global_batch_size: int
    batch_norm: BatchNormMode
    verbose: Verbose
    log_every_steps: int
    callbacks: Sequence[keras.callbacks.Callback] = ()


@dataclass(frozen=True)
class PredictJob:
    """``predict``'s arguments (run: ``_run.run_predict``, every row's outputs in input order)."""

    inputs: Readable
    global_batch_size: int
    verbose: Verbose
    callbacks: Sequence[keras.callbacks.Callback] = ()


Job = FitJob | EvaluateJob | PredictJob


def for_workers(job: Job, share: Callable[[Inputs], Inputs]) -> Job:
    """What the worker replicas get of ``job``: its arrays shared (``share``), a batch-yielding
    input as its stand-in (rank 0 reads it and broadcasts each batch) and no callbacks (rank 0
    runs them, in the caller; the loops broadcast what they decide)."""

    def stand_in(inputs: Readable) -> Readable:
        if isinstance(inputs, BatchSource):
            return SourceOnPrimary(inputs.first_rows(2), inputs.num_batches)
        return share(inputs) if isinstance(inputs, Inputs) else inputs

    if isinstance(job, FitJob):
        # a stand-in does not know its batches' size: the workers are told rank 0's
        validation_batch_size = job.arguments.validation_global_batch_size if job.validation is not None else None
        arguments = dataclasses.replace(job.arguments, callbacks=(), validation_batch_size=validation_batch_size)
        return _map_inputs(dataclasses.replace(job, arguments=arguments), stand_in)
    job = _map_inputs(job, stand_in)
    return dataclasses.replace(job, callbacks=())


def opened(job: Job) -> Job:
    """A shared job (in a worker) with its arrays memory-mapped."""
    return _map_inputs(job, lambda inputs: open_shared(inputs) if isinstance(inputs, Inputs) else inputs)


def _map_inputs(job: Job, fn: Callable[[Readable], Readable]) -> Job:
    if not isinstance(job, FitJob):
        return dataclasses.replace(job, inputs=fn(job.inputs))
    validation = None if job.validation is None else fn(job.validation)
    arguments = dataclasses.replace(job.arguments, inputs=fn(job.inputs), validation=validation)
    return dataclasses.replace(job, arguments=arguments)
