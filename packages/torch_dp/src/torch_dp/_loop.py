"""The epoch loops every replica runs: Keras's ``fit``/``evaluate``/``predict`` loops,
with callbacks and the progress bar on rank 0 only and every decision rank 0 makes
(stop, learning rate) sent to all replicas at the point Keras would act on it.

A model's own ``train_step``/``test_step``/``predict_step`` (``_custom``) runs in the same
loops on ``even_batches`` (unpadded rows); its decisions travel in a small broadcast before
each step instead of riding on the gradients' all-reduce, which the user's step owns."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import keras
import numpy as np
import torch

from dp_core import NO_STEP_TIMER, NonFiniteLoss, NoStepTimer, Preempted, PreemptionWatch, StepTimer, list_checkpoints
from dp_core.keras import (
    BatchSource,
    CheckpointWriter,
    Start,
    callback_list,
    internals,
    needs_every_batch,
    nonfinite_loss_stopped,
    skipped_message,
    verbosity,
)
from torch_dp._accumulation import Window, accumulation_window
from torch_dp._batches import Batch, EvenBatch, Readable, even_batches, replica_batches, steps_of
from torch_dp._buckets import gradient_buckets
from torch_dp._checkpoints import check_same_start, restore_metrics, save
from torch_dp._comm import Replica, all_reduce_sum, broadcast_floats, same_state_as_primary
from torch_dp._custom import CustomSteps, optimizers_of
from torch_dp._jobs import FitJob
from torch_dp._steps import Trained, global_logs, logs_of, predict_step, test_step, train_step


def _share_decisions(model: keras.Model, replica: Replica, *, stopped: bool | None = None) -> bool:
    """Rank 0's ``stop_training`` and learning rates (callbacks may change them: the model's
    optimizer's, and any other optimizer the model holds) on every replica; returns the stop.

    ``stopped`` is rank 0's stop as it was before the hook just called: one a hook sets now takes
    effect after the coming step, as in Keras, and is kept for the next call."""
    rates = [internals.learning_rate_object(optimizer) for optimizer in optimizers_of(model)]
    variables = [rate for rate in rates if isinstance(rate, keras.Variable)]
    mine = [
        float(bool(model.stop_training if stopped is None else stopped)),
        *(np.asarray(keras.ops.convert_to_numpy(rate)).item() for rate in variables),
    ]
    stop, *learning_rates = broadcast_floats(mine, replica)
    if not replica.is_primary:
        for rate, learning_rate in zip(variables, learning_rates, strict=True):
            rate.assign(learning_rate)
    if stopped is None:
        model.stop_training = bool(stop)
        return model.stop_training
    model.stop_training = bool(stop) or bool(model.stop_training)
    return bool(stop)


def _initial_epoch(model: keras.Model, initial_epoch: int, replica: Replica) -> int:
    """The first epoch, as ``model.fit`` reads it after ``on_train_begin``: one a callback set
    (``BackupAndRestore`` restoring an interrupted run), else ``initial_epoch``. Callbacks run on
    rank 0 and may have loaded weights there, so every replica takes rank 0's state."""
    chosen = internals.initial_epoch_override(model) or initial_epoch
    (chosen,) = broadcast_floats([chosen], replica)
    same_state_as_primary(model, replica, optimizer=True)
    return int(chosen)


def _has_progress_bar(callbacks: Any) -> bool:
    """A ``ProgbarLogger`` the caller passed shows batches even with ``verbose=0``, as in Keras."""
    return any(isinstance(callback, keras.callbacks.ProgbarLogger) for callback in callbacks or [])


def logs_due(step: int, steps: int | None, every: int) -> bool:
    return every > 0 and ((step + 1) % every == 0 or step + 1 == steps)


def fit_loop(
    model: keras.Model,
    job: FitJob,
    replica: Replica,
    *,
    start: Start,
    checkpoints: CheckpointWriter | None = None,
    custom: CustomSteps | None = None,
    notice: PreemptionWatch | None = None,
    timer: StepTimer | NoStepTimer = NO_STEP_TIMER,
) -> keras.callbacks.History:
    """Train on this replica's shard of every epoch from ``start``; returns this replica's History.
    ``custom`` runs the model's own ``train_step``/``test_step`` where it has them. A preemption
    ``notice`` to any replica stops all at the next step: a checkpoint, then ``Preempted``. ``timer``
    (``Trainer(profile=...)``) times the phases of Keras's own train steps."""
    arguments = job.arguments
    steps = steps_of(job.inputs, arguments.global_batch_size)
    callbacks = callback_list(
        arguments.callbacks,
        model,
        is_primary=replica.is_primary,
        verbose=arguments.verbose,
        epochs=arguments.epochs,
        steps=steps,
    )
    # Every replica must agree on when metrics are synced, so rank 0's needs are shared.
    wants = [needs_every_batch(arguments.callbacks), verbosity(arguments.verbose) == 1]
    batch_logs, progress = (bool(flag) for flag in broadcast_floats(wants, replica))
    every = 1 if batch_logs else (job.log_every_steps if progress else 0)
    model.stop_training = False
    callbacks.on_train_begin()
    if start.epoch or start.step:  # History continues from the checkpoint
        model.history.epoch, model.history.history = list(range(start.epoch)), dict(start.history)
    else:
        start = Start(epoch=_initial_epoch(model, arguments.initial_epoch, replica))
    check_same_start(start, replica)  # rank 0 chose for all (``resume_from``); a last check before any step
    # gradient accumulation: one gradient all-reduce per window (None: one per step)
    window = None if custom is not None and custom.train else accumulation_window(model, replica, job.on_nonfinite_loss)
    epoch_logs: dict[str, Any] = {}
    for epoch in range(start.epoch, arguments.epochs):
        model.reset_metrics()
        first_step = start.step if epoch == start.epoch else 0
        if first_step:
            restore_metrics(model, start, replica)
        callbacks.on_epoch_begin(epoch)
        if _share_decisions(model, replica):
            break
        if custom is not None and custom.train:
            kind: EpochSteps = OwnSteps(model, replica, custom, log_every=every)
        else:
            batch_hooks = batch_logs or progress or _has_progress_bar(arguments.callbacks)
            kind = KerasSteps(
                model, replica, window, log_every=every, decide_each_step=batch_logs, batch_hooks=batch_hooks
            )
        epoch_logs = train_epoch(
            model,
            job,
            epoch,
            replica,
            callbacks,
            kind,
            first_step=first_step,
            checkpoints=checkpoints,
            notice=notice,
            timer=timer if isinstance(kind, KerasSteps) else NO_STEP_TIMER,  # a model's own step is not timed
        )
        model.eval()
        if arguments.validates_after(epoch):
            assert job.validation is not None
            val_logs = evaluate_loop(
                model,
                job.validation,
                arguments.validation_global_batch_size,
                replica,
                callbacks=arguments.callbacks,
                in_fit=callbacks,
                custom=custom,
            )
            epoch_logs.update({f"val_{name}": value for name, value in val_logs.items()})
        callbacks.on_epoch_end(epoch, epoch_logs)
        if checkpoints is not None:
            save(checkpoints, model, replica, epoch=epoch + 1, step=0, window=window)
        if isinstance(job.inputs, BatchSource) and job.inputs.exhausted:
            model.stop_training = True  # an iterator that ran out ends training, as in Keras (rank 0 reads it)
        if _share_decisions(model, replica):
            break
    if window is not None:  # the caller's model holds the accumulators as one device would
        window.settle(model, replica)
    if arguments.epochs > start.epoch:
        model.optimizer.finalize_variable_values(model.trainable_weights)
    callbacks.on_train_end(logs=epoch_logs)
    return model.history


# Where rank 0's stop (and learning rates) reach the other replicas during an epoch:
WITH_THE_STEP = "with the step"  # on the gradients' all-reduce, which every replica then undoes on a stop
BEFORE_THE_STEP = "before the step"  # a broadcast of their own, after ``on_train_batch_begin``
AT_THE_EPOCH_END = "at the epoch end"  # no callback acts at a batch: a batch-end stop waits for the epoch's end


class EpochSteps(Protocol):
    """A kind of training step, as ``train_epoch`` runs it: Keras's own (``KerasSteps``) or the
    model's own ``train_step`` (``OwnSteps``)."""

    decisions: str  # WITH_THE_STEP, BEFORE_THE_STEP or AT_THE_EPOCH_END
    batch_hooks: bool  # whether the batch hooks are called (else no callback acts at a batch)
    window: Window | None  # a gradient accumulation window, summed into checkpoints

    def batches(self, job: FitJob, epoch: int, first_step: int) -> Iterator[Any]: ...

    def take(
        self, batch: Any, epoch: int, step: int, *, preempt: bool, stop: bool, timer: StepTimer | NoStepTimer
    ) -> Trained:
        """One step on every replica; ``preempt``: this replica got a notice (anyone's stops all)."""
        ...

    def logs(self, trained: Trained, step: int, steps: int | None, logs: dict[str, Any]) -> dict[str, Any]:
        """The logs the batch-end hook gets after ``trained`` (``logs``: the last ones)."""
        ...

    def epoch_logs(self) -> dict[str, Any]: ...


@dataclass
class KerasSteps:
    """Keras's own train step (``_steps.train_step``, or a gradient accumulation ``window``'s), on
    padded batches. With ``decide_each_step`` (callbacks act at every batch) every step sums the
    metric states and rank 0's decisions with the gradients; else logs are synced every
    ``log_every`` steps (0: never). Without ``batch_hooks`` (no callback acts at a batch, no
    progress bar) none is called: Keras would hand each step's ``on_train_batch_end`` to a thread
    of its own for nothing."""

    model: keras.Model
    replica: Replica
    window: Window | None
    log_every: int
    decide_each_step: bool
    batch_hooks: bool = True

    def __post_init__(self) -> None:
        self.decisions = WITH_THE_STEP if self.decide_each_step else AT_THE_EPOCH_END
        # large gradients: summed in buckets during backward (a window sums its own)
        self.buckets = gradient_buckets(self.model, self.replica) if self.window is None else None

    def batches(self, job: FitJob, epoch: int, first_step: int) -> Iterator[Batch]:
        return replica_batches(job.inputs, self.replica, first_step=first_step, **_epoch_order(job, epoch))

    def take(
        self, batch: Batch, epoch: int, step: int, *, preempt: bool, stop: bool, timer: StepTimer | NoStepTimer
    ) -> Trained:
        model, replica, sum_metrics = self.model, self.replica, self.decide_each_step
        if self.window is None:
            return train_step(
                model,
                batch,
                replica,
                sum_metrics=sum_metrics,
                stop=stop,
                preempt=preempt,
                timer=timer,
                buckets=self.buckets,
            )
        return self.window.train_step(
            model,
            batch,
            replica,
            epoch=epoch,
            step=step,
            sum_metrics=sum_metrics,
            stop=stop,
            preempt=preempt,
            timer=timer,
        )

    def logs(self, trained: Trained, step: int, steps: int | None, logs: dict[str, Any]) -> dict[str, Any]:
        if trained.metric_sums is not None:  # summed with the gradients: only rank 0 reads them
            return logs_of(self.model, trained.metric_sums) if self.replica.is_primary else {}
        if logs_due(step, steps, self.log_every) and not self.decide_each_step:  # a skipped step keeps its logs
            return global_logs(self.model, self.replica)
        return logs

    def epoch_logs(self) -> dict[str, Any]:
        return global_logs(self.model, self.replica)


@dataclass
class OwnSteps:
    """The model's own ``train_step`` (``_custom``), on ``even_batches``; the epoch's logs come from
    what its last step returned, as in Keras. Rank 0's decisions (stop, learning rates) are
    broadcast before every step, after ``on_train_batch_begin``, where a callback may set them."""

    model: keras.Model
    replica: Replica
    custom: CustomSteps
    log_every: int
    decisions: str = BEFORE_THE_STEP
    batch_hooks: bool = True
    window: Window | None = None  # its optimizers sum their gradients at every step
    returned: Any = None  # what the last step returned

    def batches(self, job: FitJob, epoch: int, first_step: int) -> Iterator[EvenBatch]:
        return even_batches(job.inputs, self.replica, first_step=first_step, **_epoch_order(job, epoch))

    def take(
        self, batch: EvenBatch, epoch: int, step: int, *, preempt: bool, stop: bool, timer: StepTimer | NoStepTimer
    ) -> Trained:
        # anyone's notice, in a small all-reduce of its own: the user's step owns the gradients' one
        if all_reduce_sum([torch.tensor([float(preempt)], device=self.replica.device)], self.replica)[0].item():
            return Trained(False, preempted=True)
        self.returned = self.custom.train_step(batch)
        return Trained(True)

    def logs(self, trained: Trained, step: int, steps: int | None, logs: dict[str, Any]) -> dict[str, Any]:
        return self.custom.logs(self.returned) if logs_due(step, steps, self.log_every) else logs

    def epoch_logs(self) -> dict[str, Any]:
        return self.custom.logs(self.returned)


def _epoch_order(job: FitJob, epoch: int) -> dict[str, Any]:
    arguments = job.arguments
    return {
        "global_batch_size": arguments.global_batch_size,
        "epoch": epoch,
        "seed": arguments.seed,
        "shuffle": arguments.shuffle,
    }


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
) -> dict[str, Any]:
    """One epoch of ``kind``'s steps from ``first_step``, checkpoints written as asked; returns the
    epoch's logs. The one order of every epoch (``kind`` says where rank 0's decisions travel):

    rank 0's stop from the last batch end acted on (no hook for a step not taken) ->
    ``on_train_batch_begin`` -> rank 0's decisions, when they travel before the step -> the step,
    which carries this replica's preemption notice (any replica's stops all at this step boundary:
    a checkpoint, then ``Preempted``) -> a stop that rode on it, a non-finite loss -> the logs ->
    ``on_train_batch_end`` -> a checkpoint when due.
    """
    model.train()
    steps = steps_of(job.inputs, job.arguments.global_batch_size)
    batches = kind.batches(job, epoch, first_step)
    logs: dict[str, Any] = {}
    timer.start()
    for step, batch in enumerate(batches, start=first_step):
        timer.lap("input")
        stopped = bool(model.stop_training)  # rank 0 stopped at the last batch end
        ends = stopped and kind.decisions != AT_THE_EPOCH_END
        if ends and kind.decisions == WITH_THE_STEP:
            # the stop rides on this step's all-reduce, which every replica then undoes (the callbacks
            # do not see this step)
            kind.take(batch, epoch, step, preempt=False, stop=True, timer=NO_STEP_TIMER)
            return kind.epoch_logs()
        if kind.batch_hooks and not ends:
            callbacks.on_train_batch_begin(step)
        timer.lap("callbacks")
        if kind.decisions == BEFORE_THE_STEP and _share_decisions(model, replica, stopped=stopped):
            return kind.epoch_logs()
        asked = notice is not None and notice.requested is not None
        trained = kind.take(batch, epoch, step, preempt=asked, stop=False, timer=timer)
        if trained.preempted:
            _preempted(model, replica, notice, checkpoints, epoch=epoch, step=step, window=kind.window)
        if trained.stopped:
            model.stop_training = True
            return kind.epoch_logs()
        if not trained.applied:
            _nonfinite_loss(job.on_nonfinite_loss, epoch, step, replica)
        logs = kind.logs(trained, step, steps, logs)
        if kind.batch_hooks:
            callbacks.on_train_batch_end(step, logs)
        if checkpoints is not None and checkpoints.due(step + 1, steps):
            save(checkpoints, model, replica, epoch=epoch, step=step + 1, window=kind.window)
        timer.lap("callbacks")  # logs, hooks and checkpoints
        timer.end_step()
    return kind.epoch_logs()


def _preempted(
    model: keras.Model,
    replica: Replica,
    notice: PreemptionWatch | None,
    checkpoints: CheckpointWriter | None,
    *,
    epoch: int,
    step: int,
    window: Window | None = None,
) -> NoReturn:
    """Every replica stops before ``step`` of ``epoch``: a checkpoint of that boundary, then ``Preempted``."""
    path = None
    if checkpoints is not None:
        save(checkpoints, model, replica, epoch=epoch, step=step, window=window)
        written = list_checkpoints(checkpoints.directory) if replica.is_primary else []
        path = str(written[-1]) if written else checkpoints.directory
    signal_name = notice.requested if notice is not None and notice.requested else "a notice to another replica"
    raise Preempted(signal_name=signal_name, epoch=epoch, step=step, checkpoint=path)


def _nonfinite_loss(mode: NonFiniteLoss, epoch: int, step: int, replica: Replica) -> None:
    """Every replica gets here at the same step (the check is global): stop all, or skip."""
    if mode == "stop":
        raise nonfinite_loss_stopped(epoch, step, "torch_dp")
    if replica.is_primary:
        warnings.warn(skipped_message(epoch, step), RuntimeWarning, stacklevel=2)


def evaluate_loop(
    model: keras.Model,
    inputs: Readable,
    global_batch_size: int,
    replica: Replica,
    *,
    callbacks: Sequence[keras.callbacks.Callback] = (),
    verbose: Any = 0,
    log_every_steps: int = 10,
    in_fit: keras.callbacks.CallbackList | None = None,
    custom: CustomSteps | None = None,
) -> dict[str, Any]:
    """Loss and metrics over every sample, accumulated per replica and summed once.

    ``callbacks`` get the test hooks, as from ``model.evaluate``; validation inside ``fit``
    passes the fit's own list as ``in_fit`` (Keras calls its test hooks there too, and its
    progress bar stays on the epoch). ``custom`` runs the model's own ``test_step`` if it has one.
    """
    steps = steps_of(inputs, global_batch_size)
    hooks = in_fit
    if hooks is None:
        hooks = callback_list(
            callbacks, model, is_primary=replica.is_primary, verbose=verbose, steps=steps, history=False
        )
    # rank 0's needs decide when logs are synced (only it holds the callbacks)
    wants = [needs_every_batch(callbacks, "test"), in_fit is None and verbosity(verbose) == 1]
    batch_logs, progress = (bool(flag) for flag in broadcast_floats(wants, replica))
    every = 1 if batch_logs else (log_every_steps if progress else 0)
    model.eval()
    model.reset_metrics()
    hooks.on_test_begin()
    logs: dict[str, Any] = {}
    if custom is not None and custom.test:
        returned: Any = None
        for step, batch in enumerate(even_batches(inputs, replica, global_batch_size=global_batch_size)):
            hooks.on_test_batch_begin(step)
            returned = custom.test_step(batch)
            if logs_due(step, steps, every):
                logs = custom.logs(returned)
            hooks.on_test_batch_end(step, logs)
        logs = custom.logs(returned)
        hooks.on_test_end(logs)
        return logs
    for step, batch in enumerate(replica_batches(inputs, replica, global_batch_size=global_batch_size)):
        hooks.on_test_batch_begin(step)
        test_step(model, batch, replica)
        if logs_due(step, steps, every):
            logs = global_logs(model, replica)
        hooks.on_test_batch_end(step, logs)
    logs = global_logs(model, replica)
    hooks.on_test_end(logs)
    return logs


def predict_loop(
    model: keras.Model,
    inputs: Readable,
    global_batch_size: int,
    replica: Replica,
    *,
    callbacks: Sequence[keras.callbacks.Callback] = (),
    verbose: Any = 0,
    custom: CustomSteps | None = None,
) -> tuple[Any, list[int]]:
    """This replica's predictions for its shard (padding rows included; with the model's own
    ``predict_step``, its ``even_batches`` rows), leaves concatenated, and each global batch's
    real rows; rank 0's ``callbacks`` see its own rows' outputs at each batch end."""
    steps = steps_of(inputs, global_batch_size)
    hooks = callback_list(callbacks, model, is_primary=replica.is_primary, verbose=verbose, steps=steps, history=False)
    model.eval()
    hooks.on_predict_begin()
    outputs: list[Any] = []
    real_rows: list[int] = []
    batches = (
        even_batches(inputs, replica, global_batch_size=global_batch_size)
        if custom is not None and custom.predict
        else replica_batches(inputs, replica, global_batch_size=global_batch_size)
    )
    for step, batch in enumerate(batches):
        hooks.on_predict_batch_begin(step)
        if isinstance(batch, EvenBatch):
            assert custom is not None
            outputs.append(custom.predict_step(batch))
        else:
            outputs.append(predict_step(model, batch))
        real_rows.append(batch.global_real_rows)
        hooks.on_predict_batch_end(step, {"outputs": outputs[-1]})
    hooks.on_predict_end()
    return keras.tree.map_structure(lambda *parts: np.concatenate(parts), *outputs), real_rows
