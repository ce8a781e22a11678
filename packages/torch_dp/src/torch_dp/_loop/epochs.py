"""The epoch of training steps every replica runs (``train_epoch``): one skeleton for Keras's own
step and a model's own ``train_step``, so the order of hooks, rank 0's decisions, preemption and
checkpoints is written once. Callbacks and the progress bar run on rank 0 only; every decision
rank 0 makes (stop, learning rate) reaches all replicas at the point Keras would act on it.

The two kinds of step differ in where those decisions travel (``EpochSteps.decisions``): Keras's step carries
them on its gradients' all-reduce when a callback acts at every batch (else a stop at a batch end waits for the
epoch's end); a model's own ``train_step`` (``_step.custom``) runs on ``even_batches`` (unpadded rows), and its
decisions travel in a small broadcast before each step, since the user's step owns the gradients' all-reduce.

With ``steps_per_execution=N`` all of that happens at a group's boundaries only (``_loop.groups``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import keras
import numpy as np
import torch

from dp_core import NO_STEP_TIMER, NonFiniteAction, NoStepTimer, Preempted, PreemptionWatch, StepTimer, list_checkpoints
from dp_core.keras import CheckpointWriter, FitJob, internals, nonfinite_loss_stopped, skipped_message
from torch_dp._comm.collectives import all_reduce_sum, broadcast_floats
from torch_dp._comm.replica import Replica
from torch_dp._data.batches import Batch, EvenBatch, even_batches, replica_batches, whole_last_batch
from torch_dp._loop.changes import Changes
from torch_dp._loop.checkpoints import save
from torch_dp._loop.groups import ALONE, InGroup, group_logs_due, in_group
from torch_dp._step.accumulation import Window
from torch_dp._step.custom import CustomSteps, optimizers_of
from torch_dp._step.metrics import global_logs, logs_of
from torch_dp._step.shards import REPLICATED, TrainingState
from torch_dp._step.steps import Trained, train_step
from torch_dp._step.undo import StepUndo


@dataclass(frozen=True)
class SharedDecisions:
    """Rank 0's decisions as ``share_decisions`` broadcasts them outside a step (one float each, in field order):
    its stop, whether its callbacks changed its state, each variable learning rate of the model's optimizers."""

    stop: bool
    changed: bool
    learning_rates: tuple[float, ...]

    def floats(self) -> list[float]:
        return [float(self.stop), float(self.changed), *self.learning_rates]

    @classmethod
    def of_floats(cls, values: list[float]) -> SharedDecisions:
        stop, changed, *learning_rates = values
        return cls(bool(stop), bool(changed), tuple(learning_rates))


def share_decisions(
    model: keras.Model, replica: Replica, *, stopped: bool | None = None, changes: Changes | None = None
) -> bool:
    """Rank 0's ``stop_training`` and learning rates (callbacks may change them: the model's
    optimizer's, and any other optimizer the model holds) on every replica; returns the stop.
    With ``changes``, whether a callback changed rank 0's model or optimizer travels too, and
    rank 0's state follows when it did (``_loop.changes``).

    ``stopped`` is rank 0's stop as it was before the hook just called: one a hook sets now takes
    effect after the coming step, as in Keras, and is kept for the next call."""
    rates = [internals.learning_rate_object(optimizer) for optimizer in optimizers_of(model)]
    variables = [rate for rate in rates if isinstance(rate, keras.Variable)]
    mine = SharedDecisions(
        stop=bool(model.stop_training if stopped is None else stopped),
        changed=changes is not None and changes.seen(),
        learning_rates=tuple(np.asarray(keras.ops.convert_to_numpy(rate)).item() for rate in variables),
    )
    shared = SharedDecisions.of_floats(broadcast_floats(mine.floats(), replica))
    if not replica.is_primary:
        for rate, learning_rate in zip(variables, shared.learning_rates, strict=True):
            rate.assign(learning_rate)
    if shared.changed and changes is not None:
        changes.share()
    if stopped is None:
        model.stop_training = shared.stop
        return model.stop_training
    model.stop_training = shared.stop or bool(model.stop_training)
    return shared.stop


# Where rank 0's stop (and learning rates) reach the other replicas during an epoch:
WITH_THE_STEP = "with the step"  # on the gradients' all-reduce, which every replica then undoes on a stop
BEFORE_THE_STEP = "before the step"  # a broadcast of their own, after ``on_train_batch_begin``
AT_THE_EPOCH_END = "at the epoch end"  # no callback acts at a batch: a batch-end stop waits for the epoch's end


class EpochSteps(Protocol):
    """A kind of training step, as ``train_epoch`` runs it: Keras's own (``KerasSteps``) or the
    model's own ``train_step`` (``OwnSteps``)."""

    decisions: str  # WITH_THE_STEP, BEFORE_THE_STEP or AT_THE_EPOCH_END
    batch_hooks: bool  # whether the batch hooks are called (else no callback acts at a batch)
    log_every: int  # logs are read at the epoch's first step, then every so many steps (0: never)
    window: Window | None  # a gradient accumulation window, summed into checkpoints
    state: TrainingState  # the training state, whole on every replica or sharded (gathered into checkpoints)

    def batches(self, job: FitJob, epoch: int, first_step: int) -> Iterator[Any]: ...

    def take(
        self,
        batch: Any,
        epoch: int,
        step: int,
        *,
        preempt: bool,
        stop: bool,
        timer: StepTimer | NoStepTimer,
        changed: bool = False,
        place: InGroup = ALONE,
    ) -> Trained:
        """One step on every replica; ``preempt``: this replica got a notice (anyone's stops all); ``changed``:
        rank 0's callbacks changed its state (with the step's decisions: every replica leaves the step out, for it
        to be taken again on rank 0's state). ``place``: where the step lies in its group (decisions travel with a
        group's first step, logs with its last)."""
        ...

    def logs(self, trained: Trained, due: bool, logs: dict[str, Any]) -> dict[str, Any]:
        """The logs the batch-end hook gets after ``trained``: read again when ``due`` (the same steps on every
        replica), else ``logs``, the last ones."""
        ...

    def epoch_logs(self) -> dict[str, Any]: ...


@dataclass
class KerasSteps:
    """Keras's own train step (``_step.steps.train_step``, or a gradient accumulation ``window``'s), on padded
    batches. With ``decide_each_step`` (callbacks act at every batch) every step sums the metric states and rank
    0's decisions with the gradients; else logs are synced at the epoch's first step and every ``log_every`` steps
    (0: never), as ``_loop.groups.logs_due_at`` says. Without ``batch_hooks`` (no callback acts at a batch, no
    progress bar) none is called: Keras would hand each step's ``on_train_batch_end`` to a thread for nothing."""

    model: keras.Model
    replica: Replica
    window: Window | None
    log_every: int
    decide_each_step: bool
    batch_hooks: bool = True
    apply_nonfinite: bool = False  # a TerminateOnNaN stops at a non-finite loss, after its step, as in Keras
    state: TrainingState = REPLICATED  # each replica updates every variable, or its own (``_step.shards``)

    def __post_init__(self) -> None:
        self.decisions = WITH_THE_STEP if self.decide_each_step else AT_THE_EPOCH_END
        # large gradients (or sharded ones): summed in buckets during backward (a window sums its own)
        self.buckets = self.state.buckets(self.model, self.replica) if self.window is None else None
        self.undo: StepUndo | None = None  # listed after the epoch's first step, which builds what it builds

    def batches(self, job: FitJob, epoch: int, first_step: int) -> Iterator[Batch]:
        order = job.arguments.epoch_order(epoch)
        whole_last = self.window is None and whole_last_batch(self.model, job.inputs, order, self.replica)
        return replica_batches(job.inputs, self.replica, order, first_step=first_step, whole_last=whole_last)

    def take(
        self,
        batch: Batch,
        epoch: int,
        step: int,
        *,
        preempt: bool,
        stop: bool,
        timer: StepTimer | NoStepTimer,
        changed: bool = False,
        place: InGroup = ALONE,
    ) -> Trained:
        # rank 0's decisions ride on a group's first step, the metric states for its end hook on its last
        model, replica = self.model, self.replica
        sum_metrics, decide = self.decide_each_step and (place.first or place.last), place.first
        if self.window is None:
            trained = train_step(
                model, batch, replica, sum_metrics=sum_metrics, stop=stop, changed=changed, preempt=preempt,
                timer=timer, buckets=self.buckets, apply_nonfinite=self.apply_nonfinite, state=self.state,
                decide=decide, undo=self.undo,
            )  # fmt: skip
            self.undo = self.undo or StepUndo.of(model)
            return trained
        return self.window.train_step(
            model,
            batch,
            replica,
            epoch=epoch,
            step=step,
            sum_metrics=sum_metrics,
            stop=stop,
            changed=changed,
            preempt=preempt,
            timer=timer,
            decide=decide,
        )

    def logs(self, trained: Trained, due: bool, logs: dict[str, Any]) -> dict[str, Any]:
        if trained.metric_sums is not None:  # summed with the gradients: only rank 0 reads them
            return logs_of(self.model, trained.metric_sums) if self.replica.is_primary else {}
        if due and not self.decide_each_step:  # a skipped step keeps its logs
            return global_logs(self.model, self.replica)
        return logs

    def epoch_logs(self) -> dict[str, Any]:
        return global_logs(self.model, self.replica)


@dataclass
class OwnSteps:
    """The model's own ``train_step`` (``_step.custom``), on ``even_batches``; the epoch's logs come from what its
    last step returned, as in Keras. Rank 0's decisions (stop, learning rates) are broadcast before every step,
    after ``on_train_batch_begin``, where a callback may set them."""

    model: keras.Model
    replica: Replica
    custom: CustomSteps
    log_every: int
    decisions: str = BEFORE_THE_STEP
    batch_hooks: bool = True
    window: Window | None = None  # its optimizers sum their gradients at every step
    state: TrainingState = REPLICATED  # a model's own step runs with the whole state (``shard`` is refused)
    returned: Any = None  # what the last step returned

    def batches(self, job: FitJob, epoch: int, first_step: int) -> Iterator[EvenBatch]:
        return even_batches(job.inputs, self.replica, job.arguments.epoch_order(epoch), first_step=first_step)

    def take(
        self,
        batch: EvenBatch,
        epoch: int,
        step: int,
        *,
        preempt: bool,
        stop: bool,
        timer: StepTimer | NoStepTimer,
        changed: bool = False,
        place: InGroup = ALONE,
    ) -> Trained:  # rank 0's changes travel before the step (``share_decisions``)
        # anyone's notice, at a group's first step, in a small all-reduce of its own: the user's step
        # owns the gradients' one
        notices = [torch.tensor([float(preempt)], device=self.replica.device)]
        if place.first and all_reduce_sum(notices, self.replica)[0].item():
            return Trained(False, preempted=True)
        self.returned = self.custom.train_step(batch)
        return Trained(True)

    def logs(self, trained: Trained, due: bool, logs: dict[str, Any]) -> dict[str, Any]:
        return self.custom.logs(self.returned) if due else logs

    def epoch_logs(self) -> dict[str, Any]:
        return self.custom.logs(self.returned)


def train_epoch(
    model: keras.Model,
    job: FitJob,
    epoch: int,
    replica: Replica,
    callbacks: keras.callbacks.CallbackList,
    kind: EpochSteps,
    *,
    first_step: int = 0,
    checkpoints: CheckpointWriter | None = None,
    notice: PreemptionWatch | None = None,
    timer: StepTimer | NoStepTimer = NO_STEP_TIMER,
    changes: Changes | None = None,
) -> dict[str, Any]:
    """One epoch of ``kind``'s steps from ``first_step``, checkpoints written as asked; returns the epoch's logs.
    The one order of every epoch (``kind`` says where rank 0's decisions travel), in groups of
    ``steps_per_execution`` steps (``_loop.groups``; one step each by default):

    rank 0's stop from the last group's end acted on (no hook for a step not taken) -> ``on_train_batch_begin``
    -> rank 0's decisions, when they travel before the step -> the group's first step, which carries this
    replica's preemption notice (any replica's stops all at this boundary: a checkpoint, then ``Preempted``) -> a
    stop that rode on it, a non-finite loss -> the group's other steps -> the logs -> ``on_train_batch_end`` -> a
    checkpoint when one of its steps was due.

    What rank 0's batch hooks change in its state (``changes``) travels with its decisions: before the step, or
    with it, which every replica then takes again on rank 0's state (without batch hooks that act, nothing
    changes during the epoch: the state is marked shared at its end)."""
    model.train()
    steps = job.arguments.steps_in(epoch)
    executions = job.arguments.executions
    logs: dict[str, Any] = {}
    place, step = ALONE, first_step - 1
    timer.start()
    for step, batch in enumerate(kind.batches(job, epoch, first_step), start=first_step):
        timer.lap("input")
        place = in_group(executions, step, steps, first_step=first_step)
        if place.first:
            stopped = bool(model.stop_training)  # rank 0 stopped at the last group's end
            ends = stopped and kind.decisions != AT_THE_EPOCH_END
            if ends and kind.decisions == WITH_THE_STEP:
                # the stop rides on this step's all-reduce, which every replica then undoes (the callbacks
                # do not see this step)
                kind.take(batch, epoch, step, preempt=False, stop=True, timer=NO_STEP_TIMER)
                return kind.epoch_logs()
            if kind.batch_hooks and not ends:
                callbacks.on_train_batch_begin(step)
            timer.lap("callbacks")
            if kind.decisions == BEFORE_THE_STEP and share_decisions(model, replica, stopped=stopped, changes=changes):
                return kind.epoch_logs()
        trained = _take(kind, batch, epoch, step, place, notice=notice, changes=changes, timer=timer)
        if trained.preempted:
            _preempted(model, replica, notice, checkpoints, kind, epoch=epoch, step=step)
        if trained.stopped:
            model.stop_training = True
            return kind.epoch_logs()
        if not trained.applied:
            _nonfinite_loss(job.on_nonfinite_loss, epoch, step, replica)
        if place.last:
            due = group_logs_due(executions, step, steps, kind.log_every, first_step=first_step)
            logs = kind.logs(trained, due, logs)
            _group_end(model, job, epoch, step, replica, callbacks, kind, logs, checkpoints)
        timer.lap("callbacks")  # logs, hooks and checkpoints
        timer.end_step()
    if changes is not None and kind.decisions == AT_THE_EPOCH_END:
        changes.mark()
    logs = kind.epoch_logs()
    if not place.last:  # the data ended inside a group: it ends here (the epoch's checkpoint follows)
        _group_end(model, job, epoch, step, replica, callbacks, kind, logs, None)
    return logs


def _group_end(
    model: keras.Model, job: FitJob, epoch: int, step: int, replica: Replica, callbacks: keras.callbacks.CallbackList,
    kind: EpochSteps, logs: dict[str, Any], checkpoints: CheckpointWriter | None,
) -> None:  # fmt: skip
    """After a group's last ``step``: ``on_train_batch_end`` with its ``logs`` and first step + N - 1, as Keras,
    then a checkpoint when one of its steps was due (``Executions.checkpoint_due``), but at the epoch's end,
    whose own checkpoint follows (as ``CheckpointWriter.due`` leaves the last step's)."""
    executions, steps = job.arguments.executions, job.arguments.steps_in(epoch)
    if kind.batch_hooks:
        callbacks.on_train_batch_end(executions.hook_step(step), logs)
    ends_epoch = steps is not None and step + 1 >= steps
    if checkpoints is not None and not ends_epoch and executions.checkpoint_due(checkpoints.due, step + 1, steps):
        save(checkpoints, model, replica, epoch=epoch, step=step + 1, window=kind.window, state=kind.state)


def _take(
    kind: EpochSteps,
    batch: Any,
    epoch: int,
    step: int,
    place: InGroup,
    *,
    notice: PreemptionWatch | None,
    changes: Changes | None,
    timer: StepTimer | NoStepTimer,
) -> Trained:
    """``kind``'s step on every replica, carrying this replica's preemption ``notice`` at a group's
    first step (``place``). When rank 0's callbacks changed its state and that travelled with the
    step, every replica left it out: it is taken again, on rank 0's state (``_loop.changes``)."""
    asked = place.first and notice is not None and notice.requested is not None
    changed = place.first and kind.decisions == WITH_THE_STEP and changes is not None and changes.seen()
    trained = kind.take(batch, epoch, step, preempt=asked, stop=False, timer=timer, changed=changed, place=place)
    if trained.changed and changes is not None:
        changes.share()
        trained = kind.take(batch, epoch, step, preempt=asked, stop=False, timer=timer, place=place)
    if changes is not None and kind.decisions != AT_THE_EPOCH_END and not trained.stopped:
        changes.mark()  # the step changed every replica alike (a stop leaves rank 0's changes to share)
    return trained


def _preempted(
    model: keras.Model,
    replica: Replica,
    notice: PreemptionWatch | None,
    checkpoints: CheckpointWriter | None,
    kind: EpochSteps,
    *,
    epoch: int,
    step: int,
) -> NoReturn:
    """Every replica stops before ``step`` of ``epoch``: a checkpoint of that boundary (``kind``'s
    window and state in it), then ``Preempted``."""
    path = None
    if checkpoints is not None:
        save(checkpoints, model, replica, epoch=epoch, step=step, window=kind.window, state=kind.state)
        written = list_checkpoints(checkpoints.directory) if replica.is_primary else []
        path = str(written[-1]) if written else checkpoints.directory
    signal_name = notice.requested if notice is not None and notice.requested else "a notice to another replica"
    raise Preempted(signal_name=signal_name, epoch=epoch, step=step, checkpoint=path)


def _nonfinite_loss(mode: NonFiniteAction, epoch: int, step: int, replica: Replica) -> None:
    """Every replica gets here at the same step (the check is global): stop all, or skip."""
    if mode == "stop":
        raise nonfinite_loss_stopped(epoch, step, "torch_dp")
    if replica.is_primary:
        warnings.warn(skipped_message(epoch, step), RuntimeWarning, stacklevel=2)
