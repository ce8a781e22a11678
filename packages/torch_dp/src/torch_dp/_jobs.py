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
import numpy as np
import torch

from dp_core import BatchNormMode, NonFiniteLoss, Verbose
from dp_core.keras import (
    BatchSource,
    CheckpointWriter,
    FitArguments,
    Inputs,
    LearningRatePolicy,
    learning_rate_policy_installed,
)
from torch_dp._batches import open_shared
from torch_dp._batchnorm import masked_batch_norm
from torch_dp._checkpoints import resume_from
from torch_dp._comm import Replica, all_gather_rows
from torch_dp._loop import evaluate_loop, fit_loop, predict_loop
from torch_dp._transfer import in_input_order


@dataclass(frozen=True)
class FitJob:
    """``fit``'s checked arguments and the trainer's options; ``run`` returns this replica's History."""

    arguments: FitArguments
    batch_norm: BatchNormMode
    log_every_steps: int
    on_nonfinite_loss: NonFiniteLoss
    lr_policy: LearningRatePolicy | None
    resume_from: str | None  # the checkpoint the caller chose and checked

    @property
    def inputs(self) -> Inputs:
        return rows(self.arguments.inputs)

    @property
    def validation(self) -> Inputs | None:
        return None if self.arguments.validation is None else rows(self.arguments.validation)

    def run(self, model: keras.Model, replica: Replica) -> keras.callbacks.History:
        with (
            masked_batch_norm(model, self.batch_norm, replica),
            learning_rate_policy_installed(model.optimizer, self.lr_policy),
        ):
            start = resume_from(self.resume_from, model)  # after the policy: the checkpoint's rate wins
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
            return fit_loop(model, self, replica, start=start, checkpoints=writer)


@dataclass(frozen=True)
class EvaluateJob:
    """``evaluate``'s arguments; ``run`` returns the logs over every replica's rows."""

    inputs: Inputs
    global_batch_size: int
    batch_norm: BatchNormMode
    verbose: Verbose
    log_every_steps: int
    callbacks: Sequence[keras.callbacks.Callback] = ()

    def run(self, model: keras.Model, replica: Replica) -> dict[str, Any]:
        with masked_batch_norm(model, self.batch_norm, replica):
            return evaluate_loop(
                model,
                self.inputs,
                self.global_batch_size,
                replica,
                callbacks=self.callbacks,
                verbose=self.verbose,
                log_every_steps=self.log_every_steps,
            )


@dataclass(frozen=True)
class PredictJob:
    """``predict``'s arguments; ``run`` returns every row's outputs (flat leaves, input order)."""

    inputs: Inputs
    global_batch_size: int
    verbose: Verbose
    callbacks: Sequence[keras.callbacks.Callback] = ()

    def run(self, model: keras.Model, replica: Replica) -> list[np.ndarray]:
        outputs = predict_loop(
            model, self.inputs, self.global_batch_size, replica, callbacks=self.callbacks, verbose=self.verbose
        )
        local = keras.tree.flatten(outputs)
        # gathered on every replica: one collective, and no replica needs to know which one reports
        parts = [
            [p.cpu().numpy() for p in all_gather_rows(torch.as_tensor(leaf, device=replica.device), replica)]
            for leaf in local
        ]
        by_rank = [[parts[leaf][rank] for leaf in range(len(local))] for rank in range(replica.num_replicas)]
        return in_input_order(by_rank, self.inputs.num_samples, self.global_batch_size)


Job = FitJob | EvaluateJob | PredictJob


def rows(inputs: Inputs | BatchSource, name: str = "x") -> Inputs:
    """torch-dp's replicas read rows by index; a batch-yielding input is a clear error, before any
    process starts."""
    if isinstance(inputs, BatchSource):
        raise NotImplementedError(
            f"{name} is a {type(inputs.source).__name__}, which yields batches; torch_dp's replicas read rows by "
            "index, and batch-yielding inputs are not supported on torch_dp yet. Pass arrays or a map-style dataset "
            "of rows (__len__/__getitem__ returning (x, y) rows), or train with jax_dp, which reads such sources."
        )
    return inputs


def for_workers(job: Job, share: Callable[[Inputs], Inputs]) -> Job:
    """What the worker replicas get of ``job``: its arrays shared (``share``) and no callbacks
    (rank 0 runs them, in the caller; the loops broadcast what they decide)."""
    job = _map_inputs(job, lambda inputs, name: share(inputs))
    if isinstance(job, FitJob):
        return dataclasses.replace(job, arguments=dataclasses.replace(job.arguments, callbacks=()))
    return dataclasses.replace(job, callbacks=())


def opened(job: Job) -> Job:
    """A shared job (in a worker) with its arrays memory-mapped."""
    return _map_inputs(job, lambda inputs, name: open_shared(inputs))


def _map_inputs(job: Job, fn: Callable[[Inputs, str], Inputs]) -> Job:
    if not isinstance(job, FitJob):
        return dataclasses.replace(job, inputs=fn(job.inputs, "inputs"))
    arguments = job.arguments
    validation = None if job.validation is None else fn(job.validation, "validation")
    arguments = dataclasses.replace(arguments, inputs=fn(job.inputs, "inputs"), validation=validation)
    return dataclasses.replace(job, arguments=arguments)
