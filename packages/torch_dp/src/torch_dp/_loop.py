"""The epoch loops every replica runs: Keras's ``fit``/``evaluate``/``predict`` loops,
with callbacks and the progress bar on rank 0 only and every decision rank 0 makes
(stop, learning rate) sent to all replicas at the point Keras would act on it.

A model's own ``train_step``/``test_step``/``predict_step`` (``_custom``) runs in the same
loops on ``even_batches`` (unpadded rows); its decisions travel in a small broadcast before
each step instead of riding on the gradients' all-reduce, which the user's step owns."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

import keras
import numpy as np
import torch

from dp_core import NonFiniteLoss, Preempted, PreemptionWatch, StepTimer, list_checkpoints
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
from torch_dp._batches import EvenBatch, Readable, even_batches, replica_batches, steps_of
from torch_dp._buckets import gradient_buckets
from torch_dp._checkpoints import check_same_start, restore_metrics, save
from torch_dp._comm import Replica, all_reduce_sum, broadcast_floats, same_state_as_primary
from torch_dp._custom import CustomSteps, optimizers_of
from torch_dp._jobs import FitJob
from torch_dp._steps import global_logs, logs_of, predict_step, test_step, train_step


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


def _log_now(step: int, steps: int | None, every: int) -> bool:
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
    timer: StepTimer | None = None,
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
            returned = _train_epoch_custom(
                model,
                job,
                epoch,
                replica,
                callbacks,
                custom,
                log_every=every,
                first_step=first_step,
                checkpoints=checkpoints,
                notice=notice,
            )
            epoch_logs = custom.logs(returned)
        else:
            _train_epoch(
                model,
                job,
                epoch,
                replica,
                callbacks,
                log_every=every,
                decide_each_step=batch_logs,
                batch_hooks=batch_logs or progress or _has_progress_bar(arguments.callbacks),
                first_step=first_step,
                checkpoints=checkpoints,
                notice=notice,
                timer=timer,
                window=window,
            )
            epoch_logs = global_logs(model, replica)
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


def _train_epoch(
    model: keras.Model,
    job: FitJob,
    epoch: int,
    replica: Replica,
    callbacks: keras.callbacks.CallbackList,
    *,
    log_every: int,
    decide_each_step: bool,
    batch_hooks: bool = True,
    first_step: int = 0,
    checkpoints: CheckpointWriter | None = None,
    notice: PreemptionWatch | None = None,
    timer: StepTimer | None = None,
    window: Window | None = None,
) -> None:
    """One epoch of steps from ``first_step``; logs synced every ``log_every`` steps (0: never),
    or at every step with rank 0's decisions (``decide_each_step``), checkpoints written as asked.
    A stop at the last batch end reaches the other replicas through the epoch's end. With a
    gradient accumulation ``window`` each step is one of its steps (``_accumulation``). Without
    ``batch_hooks`` (no callback acts at a batch, no progress bar) none is called: Keras would hand
    each step's ``on_train_batch_end`` to a thread of its own for nothing."""
    model.train()
    arguments = job.arguments
    steps = steps_of(job.inputs, arguments.global_batch_size)
    batches = replica_batches(
        job.inputs,
        replica,
        global_batch_size=arguments.global_batch_size,
        epoch=epoch,
        seed=arguments.seed,
        shuffle=arguments.shuffle,
        first_step=first_step,
    )
    logs: dict[str, Any] = {}
    buckets = gradient_buckets(model, replica) if window is None else None  # large gradients: during backward
    if timer is not None:
        timer.start()
    for step, batch in enumerate(batches, start=first_step):
        if timer is not None:
            timer.lap("input")
        take = (
            functools.partial(train_step, buckets=buckets)
            if window is None
            else functools.partial(window.train_step, epoch=epoch, step=step)
        )
        if decide_each_step and model.stop_training:
            # rank 0 stopped at the last batch end: the stop rides on this step's all-reduce,
            # which every replica then undoes (the callbacks do not see this step)
            take(model, batch, replica, sum_metrics=True, stop=True)
            return
        if batch_hooks:
            callbacks.on_train_batch_begin(step)
        if timer is not None:
            timer.lap("callbacks")
        asked = notice is not None and notice.requested is not None
        trained = take(model, batch, replica, sum_metrics=decide_each_step, preempt=asked, timer=timer)
        if trained.preempted:
            _preempted(model, replica, notice, checkpoints, epoch=epoch, step=step, window=window)
        if trained.stopped:
            model.stop_training = True
            return
        if not trained.applied:
            _nonfinite_loss(job.on_nonfinite_loss, epoch, step, replica)
        if trained.metric_sums is not None:  # summed with the gradients: only rank 0 reads them
            logs = logs_of(model, trained.metric_sums) if replica.is_primary else {}
        elif _log_now(step, steps, log_every) and not decide_each_step:  # a skipped step keeps its logs
            logs = global_logs(model, replica)
        if batch_hooks:
            callbacks.on_train_batch_end(step, logs)
        if checkpoints is not None and checkpoints.due(step + 1, steps):
            save(checkpoints, model, replica, epoch=epoch, step=step + 1, window=window)
        if timer is not None:  # logs, hooks and checkpoints
            timer.lap("callbacks")
            timer.end_step()


def _train_epoch_custom(
    model: keras.Model,
    job: FitJob,
    epoch: int,
    replica: Replica,
    callbacks: keras.callbacks.CallbackList,
    custom: CustomSteps,
    *,
    log_every: int,
    first_step: int = 0,
    checkpoints: CheckpointWriter | None = None,
    notice: PreemptionWatch | None = None,
) -> Any:
    """``_train_epoch`` for a model's own ``train_step``; returns what its last step returned
    (the epoch's logs come from it, as in Keras). Rank 0's decisions (stop, learning rates) are
    broadcast before every step, after ``on_train_batch_begin``, where a callback may set them."""
    arguments = job.arguments
    steps = steps_of(job.inputs, arguments.global_batch_size)
    batches = even_batches(
        job.inputs,
        replica,
        global_batch_size=arguments.global_batch_size,
        epoch=epoch,
        seed=arguments.seed,
        shuffle=arguments.shuffle,
        first_step=first_step,
    )
    model.train()
    logs: dict[str, Any] = {}
    returned: Any = None
    for step, batch in enumerate(batches, start=first_step):
        stopped = bool(model.stop_training)  # rank 0 stopped at the last batch end: no hook for a step not taken
        if not stopped:
            callbacks.on_train_batch_begin(step)
        if _share_decisions(model, replica, stopped=stopped):
            return returned
        asked = notice is not None and notice.requested is not None
        if all_reduce_sum([torch.tensor([float(asked)], device=replica.device)], replica)[0].item():  # anyone's
            _preempted(model, replica, notice, checkpoints, epoch=epoch, step=step)
        returned = custom.train_step(batch)
        if _log_now(step, steps, log_every):
            logs = custom.logs(returned)
        callbacks.on_train_batch_end(step, logs)
        if checkpoints is not None and checkpoints.due(step + 1, steps):
            save(checkpoints, model, replica, epoch=epoch, step=step + 1)
    return returned


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
            if _log_now(step, steps, every):
                logs = custom.logs(returned)
            hooks.on_test_batch_end(step, logs)
        logs = custom.logs(returned)
        hooks.on_test_end(logs)
        return logs
    for step, batch in enumerate(replica_batches(inputs, replica, global_batch_size=global_batch_size)):
        hooks.on_test_batch_begin(step)
        test_step(model, batch, replica)
        if _log_now(step, steps, every):
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
