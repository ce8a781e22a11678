"""What a backend runs for one call: a ``FitJob``, an ``EvaluateJob`` or a ``PredictJob`` (for backend authors).

A job is plain data: the call's checked arguments and the trainer's options for it, built by the
trainer and run by the backend's ``_loop.run``. It pickles (its callbacks excepted, which a
backend keeps with the process that runs them), so a backend may send it to worker processes,
swapping its inputs for stand-ins there (``SourceStandIn``) with ``dataclasses.replace``.

A fit's learning-rate policy and resume point are resolved where the backend's optimizer lives:
torch resolves them in the caller and sends them (``lr_policy``, ``resume_from``); jax makes them
inside its run (``lr_scaling``, ``warmup_steps``; ``arguments.checkpoint_dir``). One ``FitJob``
carries both kinds, each field saying which backend reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, cast

import keras

from dp_core._lr import LearningRateScaling
from dp_core._nonfinite import NonFiniteAction
from dp_core._options import BatchNormMode, ShardMode
from dp_core._trainer import Verbose
from dp_core.keras._arguments import FitArguments
from dp_core.keras._executions import ONE_STEP, Executions
from dp_core.keras._inputs import Inputs
from dp_core.keras._learning_rate import LearningRatePolicy
from dp_core.keras._sources import BatchSource


class SourceStandIn(Protocol):
    """A backend's stand-in for a batch-yielding input in a process that does not read it
    (torch's ``SourceOnPrimary`` in a worker replica): what the loops ask of it besides its batches."""

    @property
    def num_batches(self) -> int | None: ...

    def first_rows(self, count: int = 2) -> tuple[Any, Any, Any]: ...


InputsT = TypeVar("InputsT", bound="Inputs | BatchSource | SourceStandIn")
"""A job's inputs: ``Inputs | BatchSource`` as the caller passed them, or a backend's stand-in."""


@dataclass(frozen=True)
class FitJob(Generic[InputsT]):
    """``fit``'s checked arguments and the trainer's options for it; the backend's run returns the
    History (``scaling_report`` set on it when profiled)."""

    arguments: FitArguments
    batch_norm: BatchNormMode
    on_nonfinite_loss: NonFiniteAction  # "apply" with a TerminateOnNaN, as model.fit does
    profile: str | None = None  # the scaling report's folder (``Trainer(profile=...)``)
    shard: ShardMode | None = None  # what each replica holds a shard of
    # torch: resolved by the caller, so worker replicas make no choice of their own
    log_every_steps: int = 10  # how often the progress bar's logs are summed (jax reports on time)
    lr_policy: LearningRatePolicy | None = None  # ``plan_learning_rate``'s
    resume_from: str | None = None  # the checkpoint the caller chose and checked
    # jax: resolved in the run, where its optimizer makes the policy and resuming restores into it
    lr_scaling: LearningRateScaling | None = None
    warmup_steps: int = 0
    accumulate_steps: int | None = None  # gradient accumulation's window (``fit(accumulate_steps=)``)

    @property
    def inputs(self) -> InputsT:
        """The training inputs (``arguments.inputs``, which a backend's stand-in may replace)."""
        return cast("InputsT", self.arguments.inputs)

    @property
    def validation(self) -> InputsT | None:
        return cast("InputsT | None", self.arguments.validation)


@dataclass(frozen=True)
class EvaluateJob(Generic[InputsT]):
    """``evaluate``'s arguments; the backend's run returns the logs over every replica's rows."""

    inputs: InputsT
    global_batch_size: int
    batch_norm: BatchNormMode
    verbose: Verbose
    log_every_steps: int = 10  # torch's, as ``FitJob.log_every_steps``
    callbacks: Sequence[keras.callbacks.Callback] = ()
    executions: Executions = ONE_STEP  # the model's ``steps_per_execution`` (a fit's: ``arguments.executions``)


@dataclass(frozen=True)
class PredictJob(Generic[InputsT]):
    """``predict``'s arguments; the backend's run returns every row's outputs in input order."""

    inputs: InputsT
    global_batch_size: int
    verbose: Verbose
    callbacks: Sequence[keras.callbacks.Callback] = ()
    executions: Executions = ONE_STEP


Job = FitJob | EvaluateJob | PredictJob
