"""What the replicas run for one call: a ``FitJob``, an ``EvaluateJob`` or a ``PredictJob``.

Each job is plain data that can travel to a worker replica (its arrays as memory-mapped
files, see ``_batches``; its callbacks stay with the caller, rank 0, which alone runs
them) and runs on one replica with ``run``, returning that replica's result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import torch

from dp_core import BatchNormMode, NonFiniteLoss, PreemptionWatch, Verbose
from dp_core.keras import (
    BatchSource,
    CheckpointWriter,
    FitArguments,
    Inputs,
    LearningRatePolicy,
    learning_rate_policy_installed,
)
from torch_dp._batches import Readable, SourceOnPrimary, open_shared
from torch_dp._batchnorm import masked_batch_norm
from torch_dp._checkpoints import resume_from
from torch_dp._comm import Replica, all_gather_rows, all_gather_varying_rows
from torch_dp._custom import custom_steps
from torch_dp._loop import evaluate_loop, fit_loop, predict_loop
from torch_dp._profile import finish_report, step_timer, timing_batch_norm
from torch_dp._transfer import in_batch_order, in_even_order, in_input_order


@dataclass(frozen=True)
class FitJob:
    """``fit``'s checked arguments and the trainer's options; ``run`` returns this replica's History."""

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

    def run(self, model: keras.Model, replica: Replica) -> keras.callbacks.History:
        with (
            masked_batch_norm(model, self.batch_norm, replica),
            learning_rate_policy_installed(model.optimizer, self.lr_policy),
            custom_steps(model, replica, ("train_step", "test_step")) as custom,
            PreemptionWatch() as notice,
        ):
            start = resume_from(self.resume_from, model, replica)  # after the policy: the checkpoint's rate wins
            writer = None
            if self.arguments.checkpoint_dir is not None:
                writer = CheckpointWriter(
                    self.arguments.checkpoint_dir,
                    self.arguments.checkpoint_every_steps,
                    seed=self.arguments.seed,
                    global_batch_size=self.arguments.global_batch_size,
                    num_replicas=replica.num_replicas,
                    lr_policy=None if self.lr_policy is None else self.lr_policy.config(),
                )
            timer = None if self.profile is None else step_timer(replica)
            with timing_batch_norm(timer):
                history = fit_loop(
                    model, self, replica, start=start, checkpoints=writer, custom=custom, notice=notice, timer=timer
                )
            if timer is not None and self.profile is not None:
                report = finish_report(
                    timer, model, replica, global_batch_size=self.arguments.global_batch_size, folder=self.profile
                )
                history.scaling_report = report  # pyright: ignore[reportAttributeAccessIssue]
            return history


@dataclass(frozen=True)
class EvaluateJob:
    """``evaluate``'s arguments; ``run`` returns the logs over every replica's rows."""

    inputs: Readable
    global_batch_size: int
    batch_norm: BatchNormMode
    verbose: Verbose
    log_every_steps: int
    callbacks: Sequence[keras.callbacks.Callback] = ()

    def run(self, model: keras.Model, replica: Replica) -> dict[str, Any]:
        with (
            masked_batch_norm(model, self.batch_norm, replica),
            custom_steps(model, replica, ("test_step",)) as custom,
        ):
            return evaluate_loop(
                model,
                self.inputs,
                self.global_batch_size,
                replica,
                callbacks=self.callbacks,
                verbose=self.verbose,
                log_every_steps=self.log_every_steps,
                custom=custom,
            )


@dataclass(frozen=True)
class PredictJob:
    """``predict``'s arguments; ``run`` returns every row's outputs, in input order, in the
    structure the model's (or its own ``predict_step``'s) outputs have."""

    inputs: Readable
    global_batch_size: int
    verbose: Verbose
    callbacks: Sequence[keras.callbacks.Callback] = ()

    def run(self, model: keras.Model, replica: Replica) -> Any:
        with custom_steps(model, replica, ("predict_step",)) as custom:
            outputs, real_rows = predict_loop(
                model,
                self.inputs,
                self.global_batch_size,
                replica,
                callbacks=self.callbacks,
                verbose=self.verbose,
                custom=custom,
            )
        local = keras.tree.flatten(outputs)
        # gathered on every replica: one collective, and no replica needs to know which one reports
        gather = all_gather_varying_rows if custom.predict else all_gather_rows
        parts = [
            [p.cpu().numpy() for p in gather(torch.as_tensor(leaf, device=replica.device), replica)] for leaf in local
        ]
        by_rank = [[parts[leaf][rank] for leaf in range(len(local))] for rank in range(replica.num_replicas)]
        if custom.predict:  # no padding: each global batch's rows split evenly
            leaves = in_even_order(by_rank, real_rows)
        elif isinstance(self.inputs, Inputs):
            leaves = in_input_order(by_rank, self.inputs.num_samples, self.global_batch_size)
        else:
            leaves = in_batch_order(by_rank, real_rows, self.global_batch_size)
        return keras.tree.pack_sequence_as(outputs, leaves)


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
