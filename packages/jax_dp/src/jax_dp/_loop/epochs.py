"""The one epoch skeleton: an epoch's train steps, whatever the step, in one fixed order.

Keras's own train step (``KerasSteps``) and a model's own ``train_step`` (``OwnSteps``,
``_loop.step_kinds``) plug into ``EpochTrainer``, whose ``_train_steps`` alone decides what happens
around each group of ``steps_per_execution`` steps (``dp_core.keras.Executions``; a group is one
step without it), and in which order: the batch-begin hook; the group's steps; its report read on
the host when a hook or a checkpoint needs it (the progress bar's alone once the next group runs,
``Pending``; with ``stop_on_nonfinite``, a non-finite loss ends the loop there); the batch-end hook,
before a checkpoint writes the state back over what a hook changed; the checkpoint (of a group
holding a due step); the preemption check (the same group on every process); the stop decision
(process 0's, exchanged at fixed steps). Nothing runs between a group's steps, as in ``model.fit``.
The state lives on the mesh during an epoch (``HookedState`` holds the current one) and in the
caller's model around the callbacks that end it (``_step.state``).

A step kind brings how the epoch's state is read from the model, how its batches reach the
steps and a group runs (``EpochRun``), how a checkpoint is taken, and the epoch's logs.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import keras

from dp_core import NoStepTimer, StepTimer
from dp_core.keras import ONE_STEP, CheckpointWriter, Executions, Start, nonfinite_loss_stopped, skipped_message
from jax_dp._comm.hosts import agree, is_primary
from jax_dp._data.batches import Plan
from jax_dp._data.groups import Group
from jax_dp._loop import preemption
from jax_dp._loop.hooked_state import HookedState, Pending
from jax_dp._loop.reporting import BatchEndReporter, crossed_check_step
from jax_dp._mesh.layout import Placement
from jax_dp._mesh.mesh import waits_for_each_step
from jax_dp._step.optimizers import Optimizer
from jax_dp._step.state import ModelOnRequest, TrainState, counts_on_host, write_back
from jax_dp._step.steps import Report


class EpochRun(Protocol):
    """One epoch's steps of one kind: its ``groups()`` of batches from the epoch's start step, ``run``
    the steps of one (the report of its last only when asked for), and the epoch's ``logs`` with the
    optimizer state it ends with (None: read it from the model)."""

    @property
    def timer(self) -> StepTimer | NoStepTimer:
        """Times the steps; ``dp_core.NO_STEP_TIMER`` when no scaling report is asked for."""
        ...

    def groups(self) -> Iterator[Group[Any]]: ...

    def run(self, state: TrainState, group: Group[Any], *, report: bool) -> tuple[TrainState, Report | None]: ...

    def logs(self, state: TrainState) -> tuple[dict[str, Any], Any | None]: ...


class StepKind(Protocol):
    """A kind of train step, as the skeleton runs it for one fit. ``metrics``: the model's metric
    values go back and forth with the state (a model's own step, as Keras's ``jax_state_sync``)."""

    model: keras.Model
    optimizer: Optimizer
    placement: Placement
    metrics: bool

    def state_on_mesh(self, start: Start, optimizer_state: Any | None) -> TrainState: ...

    def epoch(
        self, plan: Plan, state: TrainState, *, start: int, every_batch: bool, executions: Executions
    ) -> EpochRun: ...

    def checkpoint(self, writer: CheckpointWriter, state: TrainState, *, epoch: int, step: int) -> None: ...


@dataclass(frozen=True)
class EpochTrainer:
    """How a fit trains each epoch: with ``kind``'s step, its checkpoints written by ``checkpoints``,
    at a non-finite loss stopping (``stop_on_nonfinite``) or not, its steps in ``executions``' groups."""

    kind: StepKind
    checkpoints: CheckpointWriter | None
    stop_on_nonfinite: bool
    executions: Executions = ONE_STEP

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
                executions=self.executions,
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


def _train_steps(
    kind: StepKind,
    state: TrainState,
    plan: Plan,
    callbacks: keras.callbacks.CallbackList,
    *,
    start: Start,
    executions: Executions,
    stop_on_nonfinite: bool,
    checkpoints: CheckpointWriter | None,
) -> tuple[TrainState, EpochRun]:
    """Steps ``start.step..`` of one epoch, group by group; returns the state and the run that took them.

    With ``stop_on_nonfinite`` the loop ends at the first report or checkpoint after a non-finite
    loss (later steps changed nothing; the caller raises). A report only the progress bar reads
    waits for the next group's dispatch (``Pending``).
    """
    reporter = BatchEndReporter(callbacks, "train", plan.steps)
    on_request = None
    if reporter.every_step:
        on_request = ModelOnRequest(kind.model, kind.optimizer, kind.placement, state, metrics=kind.metrics)
    run = kind.epoch(plan, state, start=start.step, every_batch=on_request is not None, executions=executions)
    current = HookedState(callbacks, state, on_request, stop_on_nonfinite=stop_on_nonfinite)
    one_at_a_time = waits_for_each_step(kind.placement.mesh)
    timer = run.timer
    timer.start()
    with contextlib.nullcontext() if on_request is None else on_request.installed(), _kept_on_error(kind, current):
        for group in run.groups():
            current.call(callbacks.on_train_batch_begin, group.first)
            timer.lap("callbacks")
            done, hook_step = group.last + 1, executions.hook_step(group.last)
            reporting = reporter.due(group.last, first=group.first)
            saving = checkpoints is not None and executions.checkpoint_due(checkpoints.due, done, plan.steps)
            current.state, report = run.run(current.state, group, report=reporting or (saving and stop_on_nonfinite))
            if one_at_a_time:
                jax.block_until_ready(current.state.counts)  # the group has ended on every device
            if current.pending_stops():
                break  # the group just run changed nothing: the one before had a non-finite loss
            if reporting and not saving and not reporter.every_step:  # only the progress bar reads it
                current.pending = Pending(report, hook_step)
            elif current.report_stops(report, hook_step, hooks=reporting):
                break
            if saving and checkpoints is not None:
                kind.checkpoint(checkpoints, current.state, epoch=start.epoch, step=done)
                current.checkpointed()
            preemption.check(done, current.state)
            timer.lap("callbacks")  # logs, hooks and checkpoints
            timer.end_step()
            if stop_requested(kind.model, done, plan.steps, first=group.first):
                break
        current.pending_stops()  # a non-finite loss: the caller raises or warns
    return current.state, run


@contextlib.contextmanager
def _kept_on_error(kind: StepKind, current: HookedState) -> Iterator[None]:
    """On an error or an interrupt within the epoch, the state of the last group run goes into a
    model whose own arrays the steps consumed (one built in ``Trainer.scope()``: its variables are the
    state, donated to each step), so it never holds deleted arrays; nothing is gathered for it, and a
    failure here never hides the error."""
    try:
        yield
    except BaseException:
        model = kind.model
        consumed = any(_deleted(variable.value) for variable in model.variables)
        alive = not any(_deleted(leaf) for leaf in jax.tree.leaves(current.state))
        if consumed and alive:
            with contextlib.suppress(Exception):
                write_back(model, kind.optimizer, current.state, metrics=kind.metrics, every_process=False)
        raise


def _deleted(value: Any) -> bool:
    return isinstance(value, jax.Array) and value.is_deleted()


def stop_requested(model: keras.Model, done: int, steps: int | None, *, first: int) -> bool:
    """Whether a callback stopped training, after the group of steps ``first..done - 1``; with
    several processes every process must stop at the same step, so process 0's decision is exchanged
    after the groups that hold a fixed step (``crossed_check_step``)."""
    if jax.process_count() == 1:
        return bool(model.stop_training)
    exchanged = crossed_check_step(first, done - 1) and (steps is None or done < steps)
    if exchanged and agree(bool(model.stop_training)):
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
