"""The epoch loops every replica runs: Keras's ``fit``/``evaluate``/``predict`` loops,
with callbacks and the progress bar on rank 0 only and every decision rank 0 makes
(stop, learning rate) sent to all replicas at the point Keras would act on it."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from dp_core import num_steps
from dp_core._keras import callback_list
from dp_core._nonfinite import NonFiniteLoss, skipped_message, stopped
from torch_dp._batches import Data, replica_batches
from torch_dp._checkpoints import CheckpointWriter, Start, restore_metrics
from torch_dp._comm import Replica, broadcast_floats
from torch_dp._steps import global_logs, predict_step, test_step, train_step

_BATCH_HOOKS = ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end")


@dataclass(frozen=True)
class FitOptions:
    global_batch_size: int
    epochs: int = 1
    shuffle: bool = True
    seed: int = 0
    verbose: Any = "auto"
    log_every_steps: int = 10
    on_nonfinite_loss: NonFiniteLoss = "stop"


def _wants_batch_logs(callbacks: Sequence[keras.callbacks.Callback] | None) -> bool:
    base = keras.callbacks.Callback
    return any(getattr(type(cb), hook) is not getattr(base, hook) for cb in callbacks or [] for hook in _BATCH_HOOKS)


def _share_decisions(model: keras.Model, replica: Replica) -> bool:
    """Rank 0's ``stop_training`` and learning rate (callbacks may change both) on every replica."""
    rate = model.optimizer._learning_rate
    rate = rate if isinstance(rate, keras.Variable) else None
    mine = [
        float(bool(model.stop_training)),
        0.0 if rate is None else np.asarray(keras.ops.convert_to_numpy(rate)).item(),
    ]
    stop, learning_rate = broadcast_floats(mine, replica)
    if rate is not None and not replica.is_primary:
        rate.assign(learning_rate)
    model.stop_training = bool(stop)
    return model.stop_training


def _log_now(step: int, steps: int, every: int) -> bool:
    return every > 0 and ((step + 1) % every == 0 or step + 1 == steps)


def fit_loop(
    model: keras.Model,
    train: Data,
    validation: Data | None,
    callbacks: Sequence[keras.callbacks.Callback] | None,
    options: FitOptions,
    replica: Replica,
    *,
    start: Start | None = None,
    checkpoints: CheckpointWriter | None = None,
) -> keras.callbacks.History:
    """Train on this replica's shard of every epoch from ``start``; returns this replica's History."""
    start = start or Start()
    steps = num_steps(train.num_samples, options.global_batch_size)
    callback_group = callback_list(
        callbacks, model, is_primary=replica.is_primary, verbose=options.verbose, epochs=options.epochs, steps=steps
    )
    # Every replica must agree on when metrics are synced, so rank 0's needs are shared.
    batch_logs, progress = (
        bool(flag) for flag in broadcast_floats([_wants_batch_logs(callbacks), options.verbose in ("auto", 1)], replica)
    )
    every = 1 if batch_logs else (options.log_every_steps if progress else 0)
    model.stop_training = False
    callback_group.on_train_begin()
    if start.epoch or start.step:  # History continues from the checkpoint
        model.history.epoch, model.history.history = list(range(start.epoch)), dict(start.history)
    epoch_logs: dict[str, Any] = {}
    for epoch in range(start.epoch, options.epochs):
        model.reset_metrics()
        first_step = start.step if epoch == start.epoch else 0
        if first_step:
            restore_metrics(model, start, replica)
        callback_group.on_epoch_begin(epoch)
        if _share_decisions(model, replica):
            break
        _train_epoch(
            model,
            train,
            epoch,
            options,
            replica,
            callback_group,
            log_every=every,
            decide_each_step=batch_logs,
            first_step=first_step,
            checkpoints=checkpoints,
        )
        epoch_logs = global_logs(model, replica)
        model.eval()
        if validation is not None:
            val_logs = evaluate_loop(model, validation, options.global_batch_size, replica)
            epoch_logs.update({f"val_{name}": value for name, value in val_logs.items()})
        callback_group.on_epoch_end(epoch, epoch_logs)
        if checkpoints is not None:
            checkpoints.at_epoch_end(model, replica, epoch=epoch)
        if _share_decisions(model, replica):
            break
    if options.epochs > start.epoch:
        model.optimizer.finalize_variable_values(model.trainable_weights)
    callback_group.on_train_end(logs=epoch_logs)
    return model.history


def _train_epoch(
    model: keras.Model,
    train: Data,
    epoch: int,
    options: FitOptions,
    replica: Replica,
    callback_group: keras.callbacks.CallbackList,
    *,
    log_every: int,
    decide_each_step: bool,
    first_step: int = 0,
    checkpoints: CheckpointWriter | None = None,
) -> None:
    """One epoch of steps from ``first_step``; logs synced every ``log_every`` steps (0: never),
    rank 0's stop shared if asked, checkpoints written as asked."""
    model.train()
    steps = num_steps(train.num_samples, options.global_batch_size)
    batches = replica_batches(
        train,
        replica,
        global_batch_size=options.global_batch_size,
        epoch=epoch,
        seed=options.seed,
        shuffle=options.shuffle,
        first_step=first_step,
    )
    logs: dict[str, Any] = {}
    for step, batch in enumerate(batches, start=first_step):
        callback_group.on_train_batch_begin(step)
        if not train_step(model, batch, replica):
            _nonfinite_loss(options.on_nonfinite_loss, epoch, step, replica)
        if _log_now(step, steps, log_every):
            logs = global_logs(model, replica)
        callback_group.on_train_batch_end(step, logs)
        if checkpoints is not None:
            checkpoints.after_step(model, replica, epoch=epoch, steps_done=step + 1, steps=steps)
        if decide_each_step and _share_decisions(model, replica):
            return


def _nonfinite_loss(mode: NonFiniteLoss, epoch: int, step: int, replica: Replica) -> None:
    """Every replica gets here at the same step (the check is global): stop all, or skip."""
    if mode == "stop":
        raise stopped(epoch, step, "torch_dp")
    if replica.is_primary:
        warnings.warn(skipped_message(epoch, step), RuntimeWarning, stacklevel=2)


def evaluate_loop(
    model: keras.Model,
    data: Data,
    global_batch_size: int,
    replica: Replica,
    *,
    verbose: Any = 0,
    log_every_steps: int = 10,
) -> dict[str, Any]:
    """Loss and metrics over every sample, accumulated per replica and summed once."""
    steps = num_steps(data.num_samples, global_batch_size)
    callbacks = callback_list(None, model, is_primary=replica.is_primary, verbose=verbose, epochs=1, steps=steps)
    every = log_every_steps if verbose in ("auto", 1) else 0
    model.eval()
    model.reset_metrics()
    callbacks.on_test_begin()
    logs: dict[str, Any] = {}
    for step, batch in enumerate(replica_batches(data, replica, global_batch_size=global_batch_size)):
        callbacks.on_test_batch_begin(step)
        test_step(model, batch, replica)
        if _log_now(step, steps, every):
            logs = global_logs(model, replica)
        callbacks.on_test_batch_end(step, logs)
    logs = global_logs(model, replica)
    callbacks.on_test_end(logs)
    return logs


def predict_loop(model: keras.Model, data: Data, global_batch_size: int, replica: Replica, *, verbose: Any = 0) -> Any:
    """This replica's predictions for its shard (padding rows included), leaves concatenated."""
    steps = num_steps(data.num_samples, global_batch_size)
    callbacks = callback_list(None, model, is_primary=replica.is_primary, verbose=verbose, epochs=1, steps=steps)
    model.eval()
    callbacks.on_predict_begin()
    outputs: list[Any] = []
    for step, batch in enumerate(replica_batches(data, replica, global_batch_size=global_batch_size)):
        callbacks.on_predict_batch_begin(step)
        outputs.append(predict_step(model, batch))
        callbacks.on_predict_batch_end(step, {"outputs": outputs[-1]})
    callbacks.on_predict_end()
    return keras.tree.map_structure(lambda *parts: np.concatenate(parts), *outputs)
