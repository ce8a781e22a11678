"""What the replicas run for one call: a ``FitJob``, an ``EvaluateJob`` or a ``PredictJob``.

Each job is plain data that can travel to a worker replica (its arrays as memory-mapped
files, see ``_processes.transfer``; its callbacks stay with the caller, rank 0, which alone runs
them); ``_loop.run.run_job`` runs one on a replica and returns that replica's result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import keras

from dp_core import BatchNormMode, NonFiniteAction, ShardMode, Verbose
from dp_core.keras import FitArguments, LearningRatePolicy
from torch_dp._data.sources import Readable


@dataclass(frozen=True)
class FitJob:
    """``fit``'s checked arguments and the trainer's options (run: ``_loop.run.run_fit``, this replica's History)."""

    arguments: FitArguments
    batch_norm: BatchNormMode
    log_every_steps: int
    on_nonfinite_loss: NonFiniteAction  # "apply" with a TerminateOnNaN, as model.fit does
    lr_policy: LearningRatePolicy | None
    resume_from: str | None  # the checkpoint the caller chose and checked
    profile: str | None = None  # the scaling report's folder (``Trainer(profile=...)``)
    shard: ShardMode | None = None  # what each replica holds a shard of (``_step.shards``)

    @property
    def inputs(self) -> Readable:
        return self.arguments.inputs

    @property
    def validation(self) -> Readable | None:
        return self.arguments.validation


@dataclass(frozen=True)
class EvaluateJob:
    """``evaluate``'s arguments (run: ``_loop.run.run_evaluate``, the logs over every replica's rows)."""

    inputs: Readable
    global_batch_size: int
    batch_norm: BatchNormMode
    verbose: Verbose
    log_every_steps: int
    callbacks: Sequence[keras.callbacks.Callback] = ()


@dataclass(frozen=True)
class PredictJob:
    """``predict``'s arguments (run: ``_loop.run.run_predict``, every row's outputs in input order)."""

    inputs: Readable
    global_batch_size: int
    verbose: Verbose
    callbacks: Sequence[keras.callbacks.Callback] = ()


Job = FitJob | EvaluateJob | PredictJob
