"""The one epoch skeleton: an epoch's train steps, whatever the step, in one fixed order.

Keras's own train step (``KerasSteps``) and a model's own ``train_step`` (``OwnSteps``) plug
into ``EpochTrainer``, whose ``_train_steps`` alone decides what happens around each step, and in
which order: the batch-begin hook; the step; its report read on the host when a hook or a
checkpoint needs it (the progress bar's alone once the next step runs, ``Pending``; with
``stop_on_nonfinite``, a non-finite loss ends the loop there); the batch-end hook, before a
checkpoint writes the state back over what a hook changed; the checkpoint; the preemption check
(the same step on every process); the stop decision (process 0's, exchanged at fixed steps).
The state lives on the mesh during an epoch (``HookedState`` holds the current one) and in the
caller's model around the callbacks that end it (``_step.state``).

A step kind brings how the epoch's state is read from the model, how its batches reach the
step and the step runs (``EpochRun``), how a checkpoint is taken, and the epoch's logs.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, final

import jax
import keras

from dp_core import NO_STEP_TIMER, NoStepTimer, StepTimer
from dp_core.keras import CheckpointWriter, Start, nonfinite_loss_stopped, skipped_message
from jax_dp._comm.hosts import agree, is_primary, replicated_to_host
from jax_dp._data.batches import Plan, device_batches, padded_batches, whole_last_batch
from jax_dp._loop import preemption
from jax_dp._loop.checkpoints import save
from jax_dp._loop.reporting import STOP_CHECK_STEPS, BatchEndReporter, final_logs, metrics_result_or_logs
from jax_dp._mesh.layout import Placement
from jax_dp._mesh.mesh import waits_for_each_step
from jax_dp._step.accumulation import accumulates
from jax_dp._step.custom import CustomTrainStep, step_data
from jax_dp._step.metrics import summed_to_host
from jax_dp._step.optimizers import Optimizer
from jax_dp._step.profile import STEP, FitProfile
from jax_dp._step.state import (
    ModelOnRequest,
    TrainState,
    counts_on_host,
    optimizer_state_of,
    train_state_on_mesh,
    write_back,
)
from jax_dp._step.steps import Report, Steps, report_on_host


class EpochRun(Protocol):
    """One epoch's steps of one kind: its ``batches()`` from the epoch's start step, ``run`` the
    step on one (its report only when asked for), and the epoch's ``logs`` with the optimizer state
    it ends with (None: read it from the model)."""

    @property
    def timer(self) -> StepTimer | NoStepTimer:
        """Times the steps; ``dp_core.NO_STEP_TIMER`` when no scaling report is asked for."""
        ...

    def batches(self) -> Iterator[tuple[int, Any]]: ...

    def run(self, state: TrainState, batch: Any, *, report: bool) -> tuple[TrainState, Report | None]: ...

    def logs(self, state: TrainState) -> tuple[dict[str, Any], Any | None]: ...


class StepKind(Protocol):
    """A kind of train step, as the skeleton runs it for one fit. ``metrics``: the model's metric
    values go back and forth with the state (a model's own step, as Keras's ``jax_state_sync``)."""

    model: keras.Model
    optimizer: Optimizer
    placement: Placement
    metrics: bool

    def state_on_mesh(self, start: Start, optimizer_state: Any | None) -> TrainState: ...

    def epoch(self, plan: Plan, state: TrainState, *, start: int, every_batch: bool) -> EpochRun: ...

    def checkpoint(self, writer: CheckpointWriter, state: TrainState, *, epoch: int, step: int) -> None: ...


@dataclass(frozen=True)
class EpochTrainer:
    """How a fit trains each epoch: with ``kind``'s step, its checkpoints written by ``checkpoints``,
    and at a non-finite loss stopping (``stop_on_nonfinite``) or not."""

    kind: StepKind
    checkpoints: CheckpointWriter | None
    stop_on_nonfinite: bool

    def __call__(
        self, plan: Plan, callbacks: keras.callbacks.CallbackList, *, start: Start, optimizer_state: Any | None
    ) -> tuple[dict[str, Any], Any | None]:
        """One epoch's ``plan`` on the mesh from ``start`` (its epoch, and the step a checkpoint left it
        at): its logs and the optimizer state to start the next epoch from (None: read it from the model).

        The model holds the trained state afterwards, for the callbacks; the rest of the state is let
        go, so validation does not hold a second copy of the weights on the devices. A preemption
        notice writes the state of the step every process stops at back, checkpoints it, and raises
        ``dp_core.Preempted``.
        """
        kind, checkpoints, stop_on_nonfinite = self.kind, self.checkpoints, self.stop_on_nonfinite
        model, optimizer = kind.model, kind.optimizer
        state = kind.state_on_mesh(start, optimizer_state)

        def checkpoint(state: TrainState, steps_done: int) -> None:
            assert checkpoints is not None
            kind.checkpoint(checkpoints, state, epoch=start.epoch, step=steps_done)

        try:
            state, run = _train_steps(
                kind,
                state,
                plan,
                callbacks,
                start=start,
                stop_on_nonfinite=stop_on_nonfinite,
                checkpoints=checkpoints,
            )
        except preemption.StoppedAt as stop:
            raise preemption.preempted(
                stop,
                epoch=start.epoch,
                write_back=lambda state: write_back(model, optimizer, state, metrics=kind.metrics),
                checkpoint=None if checkpoints is None else checkpoint,
                directory=None if checkpoints is None else checkpoints.directory,
            ) from None
        write_back(model, optimizer, state, metrics=kind.metrics)
        check_skipped(state, start, stop_on_nonfinite=stop_on_nonfinite)
        return run.logs(state)


@dataclass(frozen=True)
class Pending:
    """A step's report that only the progress bar reads: read, and its batch-end hooks called, once
    the next step is dispatched, so that the devices do not wait for the host's turn (the bar
    shows it a step later)."""

    report: Report | None
    step: int


@final
class HookedState:
    """An epoch's current state, and its batch hooks called on it. When a callback acts at every
    batch (``on_request``), the model holds ``state`` when a hook reads it, as in ``model.fit``,
    and what the hook changed (weights, learning rate) is read back into ``state`` (``ModelOnRequest``)."""

    def __init__(
        self,
        callbacks: keras.callbacks.CallbackList,
        state: TrainState,
        on_request: ModelOnRequest | None,
        *,
        stop_on_nonfinite: bool,
    ) -> None:
        self.callbacks, self.state, self.on_request = callbacks, state, on_request
        self.stop_on_nonfinite = stop_on_nonfinite
        self.pending: Pending | None = None  # the progress bar's report, not read yet

    def call(self, hook: Callable[..., None], *arguments: Any) -> None:
        if self.on_request is None:
            hook(*arguments)
        else:
            self.state = self.on_request.around(self.state, hook, *arguments)

    def report_stops(self, report: Report | None, step: int, *, hooks: bool) -> bool:
        """Reads ``report`` (waits for its step) and calls the batch-end hooks with its logs, before
        a checkpoint writes the state back over what a hook changed; whether a non-finite loss
        ends the loop there (``stop_on_nonfinite``)."""
        skipped, logs = (0, {}) if report is None else report_on_host(report)
        if skipped and self.stop_on_nonfinite:
            return True
        if hooks:
            self.call(self.callbacks.on_train_batch_end, step, logs)
        return False

    def pending_stops(self) -> bool:
        """``report_stops`` for the pending report, if any (then none is pending)."""
        pending, self.pending = self.pending, None
        return pending is not None and self.report_stops(pending.report, pending.step, hooks=True)

    def checkpointed(self) -> None:
        """A checkpoint wrote the state into the model."""
        if self.on_request is not None:
            self.on_request.written_back(self.state)


def _train_steps(
    kind: StepKind,
    state: TrainState,
    plan: Plan,
    callbacks: keras.callbacks.CallbackList,
    *,
    start: Start,
    stop_on_nonfinite: bool,
    checkpoints: CheckpointWriter | None,
) -> tuple[TrainState, EpochRun]:
    """Steps ``start.step..`` of one epoch; returns the state and the run that took them.

    With ``stop_on_nonfinite`` the loop ends at the first report or checkpoint after a non-finite
    loss (later steps changed nothing; the caller raises). A report only the progress bar reads
    waits for the next step's dispatch (``Pending``).
    """
    reporter = BatchEndReporter(callbacks, "train", plan.steps)
    on_request = None
    if reporter.every_step:
        on_request = ModelOnRequest(kind.model, kind.optimizer, kind.placement, state, metrics=kind.metrics)
    run = kind.epoch(plan, state, start=start.step, every_batch=on_request is not None)
    current = HookedState(callbacks, state, on_request, stop_on_nonfinite=stop_on_nonfinite)
    one_at_a_time = waits_for_each_step(kind.placement.mesh)
    timer = run.timer
    timer.start()
    with contextlib.nullcontext() if on_request is None else on_request.installed():
        for step, batch in run.batches():
            current.call(callbacks.on_train_batch_begin, step)
            timer.lap("callbacks")
            done = step + 1
            reporting = reporter.due(step)
            saving = checkpoints is not None and checkpoints.due(done, plan.steps)
            current.state, report = run.run(current.state, batch, report=reporting or (saving and stop_on_nonfinite))
            if one_at_a_time:
                jax.block_until_ready(current.state.counts)  # the step has ended on every device
            if current.pending_stops():
                break  # the step just run changed nothing: the one before had a non-finite loss
            if reporting and not saving and not reporter.every_step:  # only the progress bar reads it
                current.pending = Pending(report, step)
            elif current.report_stops(report, step, hooks=reporting):
                break
            if saving and checkpoints is not None:
                kind.checkpoint(checkpoints, current.state, epoch=start.epoch, step=done)
                current.checkpointed()
            preemption.check(done, current.state)
            timer.lap("callbacks")  # logs, hooks and checkpoints
            timer.end_step()
            if stop_requested(kind.model, done, plan.steps):
                break
        current.pending_stops()  # a non-finite loss: the caller raises or warns
    return current.state, run


def stop_requested(model: keras.Model, done: int, steps: int | None) -> bool:
    """Whether a callback stopped training; with several processes every process must stop at the
    same step, so process 0's decision is exchanged at fixed steps."""
    if jax.process_count() == 1:
        return bool(model.stop_training)
    if done % STOP_CHECK_STEPS == 0 and (steps is None or done < steps) and agree(bool(model.stop_training)):
        model.stop_training = True
        return True
    return False


def check_skipped(state: TrainState, start: Start, *, stop_on_nonfinite: bool) -> None:
    """At an epoch's end: raise for a step with a non-finite loss (``stop_on_nonfinite``), else warn
    once how many were skipped."""
    counts = counts_on_host(state)
    if counts.skipped and stop_on_nonfinite:
        raise nonfinite_loss_stopped(start.epoch, start.step + counts.first_skipped, "jax_dp")
    if counts.skipped and is_primary():
        message = skipped_message(start.epoch, start.step + counts.first_skipped, counts.skipped)
        warnings.warn(message, RuntimeWarning, stacklevel=6)  # at the trainer's fit


@final
class KerasSteps:
    """Keras's own train step (``_step.steps``) in the skeleton; ``profile`` times its phases."""

    metrics = False

    def __init__(
        self, model: keras.Model, optimizer: Optimizer, steps: Steps, placement: Placement, profile: FitProfile | None
    ) -> None:
        self.model, self.optimizer, self.steps, self.profile = model, optimizer, steps, profile
        self.placement = placement

    def state_on_mesh(self, start: Start, optimizer_state: Any | None) -> TrainState:
        return train_state_on_mesh(
            self.model,
            self.optimizer,
            self.placement,
            previous_optimizer_state=optimizer_state,
            metric_sums=start.metric_variables if start.step else None,
            accumulate=True,
        )

    def epoch(self, plan: Plan, state: TrainState, *, start: int, every_batch: bool) -> _KerasRun:
        return _KerasRun(self, plan, state, start=start, every_batch=every_batch)

    def checkpoint(self, writer: CheckpointWriter, state: TrainState, *, epoch: int, step: int) -> None:
        model, optimizer = self.model, self.optimizer
        sums = summed_to_host(state.metrics, self.placement.mesh)  # a collective: every process
        write_back(model, optimizer, state)
        optimizer_state = optimizer_state_of(optimizer, state)  # mid-window: one device's accumulators
        save(writer, model, optimizer, optimizer_state, epoch=epoch, step=step, metric_variables=sums)


@final
class _KerasRun:
    """One epoch of Keras's step: the next batch is prepared while the devices run a step. When a
    callback reads every batch, each step is one program that also reports (``train_reporting``);
    otherwise the few steps that report (the progress bar's) add a small program of their own."""

    def __init__(self, kind: KerasSteps, plan: Plan, state: TrainState, *, start: int, every_batch: bool) -> None:
        self.kind = kind
        whole_last = not accumulates(kind.optimizer) and whole_last_batch(kind.model, plan)
        padded = padded_batches(plan, whole_last=whole_last)
        self._padded, self._every_batch = padded, every_batch
        batches = device_batches(plan, kind.placement.mesh, start=start, whole_last=whole_last)
        self._batches = enumerate(batches, start=start)
        self._upcoming = next(self._batches, None)
        self._state = state  # what the last step returned: a profile's synced lap waits for it
        first = None if self._upcoming is None else self._upcoming[1]
        profile = kind.profile
        self.timer = NO_STEP_TIMER if profile is None else profile.epoch_timer(first, lambda: self._state)

    def batches(self) -> Iterator[tuple[int, Any]]:
        while self._upcoming is not None:  # the next one is taken in ``run``
            yield self._upcoming

    def run(self, state: TrainState, batch: Any, *, report: bool) -> tuple[TrainState, Report | None]:
        steps = self.kind.steps
        step_report = None
        if self._every_batch:
            state, step_report = steps.train_reporting(state, batch, self._padded)
        else:
            state = steps.train(state, batch, self._padded)
            if report:
                step_report = steps.report(state.metrics, state.counts.skipped)
        self._state = state
        self.timer.lap(STEP)
        self._upcoming = next(self._batches, None)  # prepared while the devices run the step
        self.timer.lap("input")  # the host's time for the next batch, then the rest of the step
        self.timer.lap(STEP, sync=True)
        return state, step_report

    def logs(self, state: TrainState) -> tuple[dict[str, Any], Any]:
        kind = self.kind
        logs = final_logs(kind.model, kind.steps, state.metrics, kind.placement.mesh)
        return logs, optimizer_state_of(kind.optimizer, state)


@final
class OwnSteps:
    """The model's own ``train_step`` (``_step.custom``) in the skeleton, as Keras's ``JAXTrainer``
    runs it: the metric values go with the state; the epoch's logs are the model's metric results
    when the step's logs name exactly those metrics, else the last step's logs."""

    metrics = True

    def __init__(
        self, model: keras.Model, optimizer: Optimizer, train_step: CustomTrainStep, placement: Placement
    ) -> None:
        self.model, self.optimizer, self.train_step, self.placement = model, optimizer, train_step, placement

    def state_on_mesh(self, start: Start, optimizer_state: Any | None) -> TrainState:
        del optimizer_state  # a Keras optimizer's: read from the model every epoch
        return train_state_on_mesh(
            self.model,
            self.optimizer,
            self.placement,
            previous_optimizer_state=None,
            metric_sums=start.metric_variables if start.step else None,
            whole_metrics=True,
        )

    def epoch(self, plan: Plan, state: TrainState, *, start: int, every_batch: bool) -> _OwnRun:
        return _OwnRun(self, plan, start=start)

    def checkpoint(self, writer: CheckpointWriter, state: TrainState, *, epoch: int, step: int) -> None:
        write_back(self.model, self.optimizer, state, metrics=True)
        metric_variables = list(replicated_to_host(state.metrics))
        save(writer, self.model, self.optimizer, None, epoch=epoch, step=step, metric_variables=metric_variables)


@final
class _OwnRun:
    """One epoch of the model's own step, one at a time; not profiled."""

    def __init__(self, kind: OwnSteps, plan: Plan, *, start: int) -> None:
        self.kind, self.plan, self.start = kind, plan, start
        self.last_logs: Any = None  # the last step's, on the devices; None when no step ran

    @property
    def timer(self) -> NoStepTimer:
        return NO_STEP_TIMER

    def batches(self) -> Iterator[tuple[int, Any]]:
        return enumerate(step_data(self.plan, self.kind.placement.mesh, start=self.start), start=self.start)

    def run(self, state: TrainState, batch: Any, *, report: bool) -> tuple[TrainState, Report | None]:
        state, step_report = self.kind.train_step(state, batch)
        self.last_logs = step_report.logs
        return state, step_report if report else None

    def logs(self, state: TrainState) -> tuple[dict[str, Any], None]:
        return metrics_result_or_logs(self.kind.model, self.last_logs), None
