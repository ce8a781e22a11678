"""The kinds of train step the epoch skeleton (``_loop.epochs``) runs, and one epoch of each.

Keras's own train step (``KerasSteps``) runs a whole ``steps_per_execution`` group of same-shaped
batches as one compiled scan (``_step.scan``): one host dispatch per group; a shorter group (the
epoch's last), one holding a batch placed whole, or a profiled fit (which times each step) runs its
steps one by one. A model's own ``train_step`` (``OwnSteps``) runs its steps one by one, as Keras
3.15's jax trainer runs a group of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, final

import keras

from dp_core import NO_STEP_TIMER, NoStepTimer
from dp_core.keras import CheckpointWriter, Executions, Start
from jax_dp._comm.hosts import replicated_to_host
from jax_dp._data.batches import Batch, Plan, padded_batches, whole_last_batch
from jax_dp._data.groups import Group, device_groups, groups_of
from jax_dp._loop.checkpoints import save
from jax_dp._loop.reporting import final_logs, metrics_result_or_logs
from jax_dp._mesh.layout import Placement
from jax_dp._step.accumulation import accumulates
from jax_dp._step.custom import CustomTrainStep, step_data
from jax_dp._step.metrics import summed_to_host
from jax_dp._step.optimizers import Optimizer
from jax_dp._step.profile import STEP, FitProfile
from jax_dp._step.state import TrainState, optimizer_state_of, train_state_on_mesh, write_back
from jax_dp._step.steps import Report, Steps


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

    def epoch(
        self, plan: Plan, state: TrainState, *, start: int, every_batch: bool, executions: Executions
    ) -> _KerasRun:
        return _KerasRun(self, plan, state, start=start, every_batch=every_batch, executions=executions)

    def checkpoint(self, writer: CheckpointWriter, state: TrainState, *, epoch: int, step: int) -> None:
        model, optimizer = self.model, self.optimizer
        sums = summed_to_host(state.metrics, self.placement.mesh)  # a collective: every process
        write_back(model, optimizer, state)
        optimizer_state = optimizer_state_of(optimizer, state)  # mid-window: one device's accumulators
        save(writer, model, optimizer, optimizer_state, epoch=epoch, step=step, metric_variables=sums)


@final
class _KerasRun:
    """One epoch of Keras's step: the next group is prepared while the devices run one. A whole
    group of same-shaped batches is one program (``train_scanned``, which also reports); otherwise,
    when a callback reads every batch, each step is one program that also reports
    (``train_reporting``), and else the few groups that report (the progress bar's) add a small
    program of their own."""

    def __init__(
        self,
        kind: KerasSteps,
        plan: Plan,
        state: TrainState,
        *,
        start: int,
        every_batch: bool,
        executions: Executions,
    ) -> None:
        self.kind = kind
        whole_last = not accumulates(kind.optimizer) and whole_last_batch(kind.model, plan)
        self._padded, self._every_batch = padded_batches(plan, whole_last=whole_last), every_batch
        profile = kind.profile
        self._groups = device_groups(  # a profile times each step apart: no group runs as one program
            plan, kind.placement.mesh, executions, start=start, whole_last=whole_last, stack=profile is None
        )
        self._upcoming = next(self._groups, None)
        self._state = state  # what the last step returned: a profile's synced lap waits for it
        first = None if self._upcoming is None or not self._upcoming.batches else self._upcoming.batches[0]
        self.timer = NO_STEP_TIMER if profile is None else profile.epoch_timer(first, lambda: self._state)

    def groups(self) -> Iterator[Group[Batch]]:
        while self._upcoming is not None:  # the next one is taken in ``run``
            yield self._upcoming

    def run(self, state: TrainState, group: Group[Batch], *, report: bool) -> tuple[TrainState, Report | None]:
        if group.stacked is not None:
            state, group_report = self.kind.steps.train_scanned(state, group.stacked, self._padded)
        else:
            state, group_report = self._one_by_one(state, group.batches, report=report)
        self._state = state
        self.timer.lap(STEP)
        self._upcoming = next(self._groups, None)  # prepared while the devices run the group
        self.timer.lap("input")  # the host's time for the next group, then the rest of the group's steps
        self.timer.lap(STEP, sync=True)
        return state, group_report if report else None

    def _one_by_one(
        self, state: TrainState, batches: tuple[Batch, ...], *, report: bool
    ) -> tuple[TrainState, Report | None]:
        """The group's steps one program each; the report of the last when ``report``. A profile
        counts each step apart: every step but the last ends here, the last in the loop."""
        steps, step_report = self.kind.steps, None
        for at, batch in enumerate(batches):
            if at:
                self.timer.lap(STEP, sync=True)
                self.timer.end_step()
            if self._every_batch:
                state, step_report = steps.train_reporting(state, batch, self._padded)
            else:
                state = steps.train(state, batch, self._padded)
            self._state = state  # a profile's synced lap waits for it
        if report and step_report is None:
            step_report = steps.report(state.metrics, state.counts.skipped)
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

    def epoch(self, plan: Plan, state: TrainState, *, start: int, every_batch: bool, executions: Executions) -> _OwnRun:
        return _OwnRun(self, plan, start=start, executions=executions)

    def checkpoint(self, writer: CheckpointWriter, state: TrainState, *, epoch: int, step: int) -> None:
        write_back(self.model, self.optimizer, state, metrics=True)
        metric_variables = list(replicated_to_host(state.metrics))
        save(writer, self.model, self.optimizer, None, epoch=epoch, step=step, metric_variables=metric_variables)


@final
class _OwnRun:
    """One epoch of the model's own step, one step (one program) at a time; not profiled."""

    def __init__(self, kind: OwnSteps, plan: Plan, *, start: int, executions: Executions) -> None:
        self.kind, self.plan, self.start, self.executions = kind, plan, start, executions
        self.last_logs: Any = None  # the last step's, on the devices; None when no step ran

    @property
    def timer(self) -> NoStepTimer:
        return NO_STEP_TIMER

    def groups(self) -> Iterator[Group[Any]]:
        data = step_data(self.plan, self.kind.placement.mesh, start=self.start)
        return groups_of(data, self.executions, self.plan.steps, start=self.start)

    def run(self, state: TrainState, group: Group[Any], *, report: bool) -> tuple[TrainState, Report | None]:
        step_report = None
        for data in group.batches:
            state, step_report = self.kind.train_step(state, data)
            self.last_logs = step_report.logs
        return state, step_report if report else None

    def logs(self, state: TrainState) -> tuple[dict[str, Any], None]:
        return metrics_result_or_logs(self.kind.model, self.last_logs), None
