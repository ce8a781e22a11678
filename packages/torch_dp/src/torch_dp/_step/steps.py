"""One training, evaluation or prediction step of one replica, and the logs of all.

A step mirrors Keras's ``TorchTrainer.train_step`` (compiled loss, loss tracker,
``optimizer.apply``, ``compute_metrics``) with three changes that make N replicas
equal one: each replica back-propagates its share of the global batch's loss
(``dp_core.keras.replica_losses`` gives ``num_replicas`` times it: real rows only,
normalized over the whole global batch, Keras masks included), gradients are summed between
``backward`` and ``apply``, and metrics see only real rows.

Gradients are summed in buckets during ``backward`` as DDP sums them (``_step.buckets``), the
step's loss, flags and metric states riding in the last bucket, rather than by wrapping the
model in DDP: Keras variables are not registered the way DDP's reducer expects on every model
(nested Keras layers, unused branches), and DDP would also broadcast buffers Keras does not use.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import keras
import torch

from dp_core import NO_STEP_TIMER, NoStepTimer, StepTimer
from dp_core.keras import GlobalRows, ReplicaRows, global_batch_draws, internals, map_structure, replica_losses
from torch_dp._comm.collectives import all_reduce_sum
from torch_dp._comm.replica import Replica
from torch_dp._data.batches import Batch
from torch_dp._step.batchnorm import real_rows
from torch_dp._step.buckets import GradientBuckets
from torch_dp._step.reduction import (
    Agreed,
    ReductionLayout,
    all_reduce_after,
    decisions_on_device,
    flag,
    learning_rate_variable,
)
from torch_dp._step.shards import REPLICATED, TrainingState
from torch_dp._step.undo import StepUndo


def _forward(model: keras.Model, x: Any, training: bool) -> Any:
    return model(x, **internals.training_kwargs(model, training))


def _replica_rows(batch: Batch, replica: Replica) -> ReplicaRows:
    """What ``replica_losses`` needs to know of this replica's part of the global batch (a whole
    batch: all of it, so Keras's own reduction applies)."""
    if batch.whole:
        return ReplicaRows(batch.rows, batch.rows)

    def sum_over_replicas(value: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum([value], replica)[0]

    return ReplicaRows(batch.rows, batch.global_real_rows, replica.num_replicas, batch.mask, sum_over_replicas)


def _draws(batch: Batch, replica: Replica | None) -> GlobalRows:
    """Where this replica's rows sit in the global batch its random layers draw for: a replica's part
    is contiguous, ``rank * rows`` on, padding at the end (``Batch``); a whole batch is its own."""
    if batch.whole or replica is None:
        return GlobalRows(batch.rows, batch.rows, 0)
    return GlobalRows(batch.rows, batch.global_real_rows, replica.rank * batch.rows)


def _compute_loss(model: keras.Model, batch: Batch, y_pred: Any, *, training: bool) -> Any:
    """Keras's loss on this replica's rows (inside ``replica_losses``: its scaled share of the
    global batch's); the ``loss`` tracker counts the batch's rows, as Keras's ``train_step`` does."""
    loss = internals.compute_loss(
        model, x=batch.x, y=batch.y, y_pred=y_pred, sample_weight=batch.sample_weight, training=training
    )
    tracker = internals.loss_tracker(model)
    assert tracker is not None  # every compiled model has one
    # detached, as Keras 3.16's step: the tracker's arithmetic joins no graph (the same value)
    tracker.update_state(loss.detach() if isinstance(loss, torch.Tensor) else loss, sample_weight=batch.rows)
    return loss


@contextlib.contextmanager
def _weigh_losses_by_real_rows(model: keras.Model, batch: Batch, replica: Replica) -> Iterator[None]:
    """Keras weighs each batch's loss by its row count; on a padded batch use its real rows.

    Single-device Keras gives its short last batch the weight of its real rows; here
    every replica's batch is padded to full size, so the update its loss trackers
    just made is rescaled to ``global_real_rows / num_replicas``.
    """
    if not batch.partial:
        yield
        return
    trackers = internals.loss_trackers(model)
    before = [[v.value.detach().clone() for v in m.variables] for m in trackers]
    yield
    factor = batch.global_real_rows / (replica.num_replicas * batch.rows)
    for metric, old_values in zip(trackers, before, strict=True):
        for variable, old in zip(metric.variables, old_values, strict=True):
            variable.assign(old + (variable.value.detach() - old) * factor)


@contextlib.contextmanager
def _counted_once(model: keras.Model, batch: Batch, replica: Replica) -> Iterator[None]:
    """Within the block, metric updates count on rank 0 only when every replica holds the whole
    batch: the states summed over replicas then hold it once, as in ``model.fit``."""
    if not batch.whole or replica.is_primary:
        yield
        return
    before = [(v, v.value.detach().clone()) for v in model.metrics_variables]
    try:
        yield
    finally:
        for variable, value in before:
            variable.assign(value)


def _update_metrics(model: keras.Model, batch: Batch, y_pred: Any) -> None:
    """Metrics over this replica's real rows only (plain ``metrics=`` ignore sample weights)."""
    if not batch.partial:
        _compute_metrics(model, batch.x, batch.y, y_pred, batch.sample_weight)
        return
    if batch.real_rows == 0:
        return
    x, y, y_pred, weight = (
        map_structure(lambda t: _with_mask_of(t, t[: batch.real_rows]), part)
        for part in (batch.x, batch.y, y_pred, batch.sample_weight)
    )
    _compute_metrics(model, x, y, y_pred, weight)


def _compute_metrics(model: keras.Model, x: Any, y: Any, y_pred: Any, sample_weight: Any) -> None:
    """``model.compute_metrics``, which Keras's step calls; Keras's own only updates the compiled
    metrics and then reads every result, which a step does not use (logs are read when needed)."""
    if type(model).compute_metrics is not keras.Model.compute_metrics:  # the model's own runs as written
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    elif (compiled := internals.compile_metrics(model)) is not None:
        compiled.update_state(y, y_pred, sample_weight=sample_weight)


def _with_mask_of(tensor: Any, part: Any) -> Any:
    """``part`` (rows of ``tensor``, or it detached) with those rows of ``tensor``'s Keras mask,
    which metrics and losses read from ``y_pred``."""
    mask = internals.keras_mask(tensor)
    if mask is not None:
        internals.set_keras_mask(part, mask[: len(part)])
    return part


def _detached(y_pred: Any) -> Any:
    return map_structure(lambda t: _with_mask_of(t, t.detach()) if isinstance(t, torch.Tensor) else t, y_pred)


class Trained(NamedTuple):
    """What a training step did: whether its update was applied (False: a non-finite loss on
    some replica, rank 0 stopping, or a preemption notice, and nothing changed), whether rank 0
    stopped training before it, whether some replica was preempted, and, when asked for, the
    metric states summed over every replica."""

    applied: bool
    stopped: bool = False
    metric_sums: list[torch.Tensor] | None = None
    preempted: bool = False
    changed: bool = False  # rank 0's callbacks changed its state: every replica left the step out


def notice_in_row(preempt: bool, replica: Replica) -> bool:
    """``preempt`` (this process got a preemption notice), or on a mesh any of its row's processes' (they
    hold the other parts of the replica's layers: every process of the mesh must stop at the same step,
    which the step's all-reduce over the column then tells every row). Every process of a row calls it at
    every step."""
    row = replica.partners
    if row is None or not row.distributed:
        return preempt
    return bool(all_reduce_sum([flag(preempt, row)], row)[0].item())


def train_step(
    model: keras.Model,
    batch: Batch,
    replica: Replica,
    *,
    sum_metrics: bool = False,
    stop: bool = False,
    changed: bool = False,
    preempt: bool = False,
    timer: StepTimer | NoStepTimer = NO_STEP_TIMER,
    buckets: GradientBuckets | None = None,
    apply_nonfinite: bool = False,
    state: TrainingState = REPLICATED,
    decide: bool = True,
    undo: StepUndo | None = None,
) -> Trained:
    """Forward, exact global-batch gradient, Keras optimizer update, metric update.

    Nothing changes (weights, optimizer, BatchNorm statistics, metrics) when the loss of any replica is not
    finite: every replica learns it from the same all-reduce as the gradients, so all skip the update together.

    With ``sum_metrics`` (callbacks act at every batch) that one all-reduce also carries the
    metric states (metrics read only this step's predictions, so they are updated before it)
    and rank 0's ``Decisions`` since the last step (``_step.reduction``): its learning rate, which
    every replica takes before applying, ``stop`` (every replica undoes this step and leaves the
    epoch) and ``changed`` (rank 0's callbacks changed its model or optimizer: every replica undoes
    this step, to take it again on rank 0's state, ``_loop.changes``). So a batch-level callback
    costs no collective of its own (``decide=False``: the metric states travel without decisions, at
    a group's last step, ``_loop.groups``). ``preempt`` (this replica got a preemption notice) rides on it
    always: when any replica sends it, every replica undoes this step, so all stop at the same step.

    The host reads the few values that decide the update once the all-reduce is done (``Agreed``):
    a skipped or stopped step must leave the weights and the optimizer untouched on every replica,
    and Keras's optimizer cannot be told on the device to leave a step out. Everything else (logs,
    metrics) stays on the device until read. With ``apply_nonfinite`` (a ``TerminateOnNaN`` among
    the callbacks) such a step is applied, as ``model.fit`` applies it, and the callback stops
    training at its batch end.

    ``timer`` (``Trainer(profile=...)``) gets laps for forward+backward, the all-reduce and the optimizer. With
    ``buckets`` (large gradients, ``_step.buckets``) the gradients are summed in buckets started during backward,
    the other values riding in the last. ``state`` applies the update (``_step.shards``); ``undo`` (a
    ``StepUndo.of(model)`` kept between steps) copies what a step left out puts back."""
    before = StepUndo.of(model) if undo is None else undo.take()
    shared = sum_metrics and replica.distributed  # one replica: its own states are the global ones
    rate = learning_rate_variable(model)
    decided = shared and decide
    decisions = decisions_on_device(rate, replica, stop=stop, changed=changed) if decided else None
    loss = forward_loss(model, batch, replica)
    layout = ReductionLayout.of(model, logs=shared, decisions=decided)  # once the metrics are built
    loss_value = torch.as_tensor(loss).detach().reshape(1).to(torch.float32)
    preempted = notice_in_row(preempt, replica)
    alone = not replica.distributed and buckets is None  # nothing to sum with: the values are read as they are
    extras = [] if alone else layout.pack(loss_value, flag(preempted, replica), model, decisions)
    trainable, local = backward(model, loss, replica, buckets=buckets, extras=extras)
    timer.lap("forward_backward", sync=True)
    summed_gradients, summed = _summed(trainable, local, extras, replica, buckets, timer)
    agreed = Agreed(not math.isfinite(loss_value.tolist()[0]), preempted, None) if alone else layout.read(summed)
    timer.lap("all_reduce")  # the host read waited for the all-reduce, and so for the slowest replica
    ended = act_on_agreed(model, before, replica, rate, agreed)
    if ended is not None:
        return ended
    if agreed.nonfinite and not apply_nonfinite:  # ``apply_nonfinite``: as model.fit, for a TerminateOnNaN to stop
        before.put_back(model)
        return Trained(False)
    state.apply(model, trainable, local, summed_gradients, timer)
    timer.lap("optimizer", sync=True)
    if not sum_metrics:
        return Trained(True)
    metric_sums = layout.metric_sums(summed) if shared else [v.value.detach() for v in model.metrics_variables]
    return Trained(True, metric_sums=metric_sums)


def _summed(
    trainable: list[keras.Variable],
    local: list[torch.Tensor | None],
    extras: list[torch.Tensor],
    replica: Replica,
    buckets: GradientBuckets | None,
    timer: StepTimer | NoStepTimer,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gradients and ``extras`` summed over replicas: in the buckets backward started, or in one
    all-reduce. Zeros keep the buffer the same size on every replica; a variable with no gradient here
    is still skipped by the optimizer, as in Keras."""
    if buckets is None:
        gradients = [torch.zeros_like(v.value) if g is None else g for v, g in zip(trainable, local, strict=True)]
        return all_reduce_after(gradients, extras, replica)
    summed_gradients, summed_extras = buckets.summed(trainable)
    timer.note("all_reduce_overlapped", buckets.overlapped)
    return summed_gradients, all_reduce_sum(extras, replica) if summed_extras is None else summed_extras


def forward_loss(model: keras.Model, batch: Batch, replica: Replica) -> Any:
    """Forward, loss and metric update on this replica's rows; returns the loss (``num_replicas``
    times its share of the global batch's). No collective but the synchronized BatchNorm moments
    (``_step.batchnorm``)."""
    with _counted_once(model, batch, replica):
        with replica_losses(model, _replica_rows(batch, replica)):  # activity regularizers run in the forward pass
            with real_rows(batch.mask, whole=batch.whole), global_batch_draws(_draws(batch, replica)):
                y_pred = _forward(model, batch.x, training=True)
            model.zero_grad()
            with _weigh_losses_by_real_rows(model, batch, replica):
                loss = _compute_loss(model, batch, y_pred, training=True)
        with torch.no_grad():
            _update_metrics(model, batch, _detached(y_pred))
    return loss


class LocalGradients(NamedTuple):
    """One replica's backward pass: the trainable variables and their gradients (None where one got none)."""

    trainable: list[keras.Variable]
    gradients: list[torch.Tensor | None]


def backward(
    model: keras.Model,
    loss: Any,
    replica: Replica,
    *,
    buckets: GradientBuckets | None = None,
    extras: list[torch.Tensor] | None = None,
) -> LocalGradients:
    """This replica's gradients of ``forward_loss``'s ``loss``. With ``buckets``, the gradients' own
    all-reduces start during backward (``GradientBuckets.summed`` collects them), and the step's
    ``extras`` (``ReductionLayout.pack``'s) ride in the last bucket."""
    trainable = model.trainable_weights[:]
    if trainable:
        # Back-propagate the share itself (the loss is num_replicas times it; on a whole batch,
        # every replica's is the batch's own) and sum the gradients: every row's gradient then has
        # Keras's own magnitude, so float16 loss scaling overflows exactly where model.fit's does.
        with contextlib.nullcontext() if buckets is None else buckets.reducing(trainable, extras or [], replica.group):
            share = loss if replica.num_replicas == 1 else loss / replica.num_replicas  # no node for a division by 1
            model.optimizer.scale_loss(share).backward()
    return LocalGradients(trainable, [v.value.grad for v in trainable])


def act_on_agreed(
    model: keras.Model,
    before: StepUndo,
    replica: Replica,
    rate: keras.Variable | None,
    agreed: Agreed,
) -> Trained | None:
    """What every replica does with a step's ``Agreed`` values: a preemption notice or rank 0's stop
    or change undoes the step (the ``Trained`` to return); otherwise rank 0's learning rate is taken, None."""
    if agreed.preempted:
        before.put_back(model)
        return Trained(False, preempted=True)
    decisions = agreed.decisions
    if decisions is None:
        return None
    if decisions.stop:
        before.put_back(model)
        return Trained(False, stopped=True)
    if decisions.changed:
        before.put_back(model)
        return Trained(False, changed=True)
    if rate is not None and not replica.is_primary:
        rate.assign(decisions.learning_rate)
    return None


def test_step(model: keras.Model, batch: Batch, replica: Replica) -> None:
    """Loss and metrics of one batch, accumulated locally (synced by ``_step.metrics.global_logs``)."""
    with _counted_once(model, batch, replica):
        with torch.no_grad(), replica_losses(model, _replica_rows(batch, replica)):
            with global_batch_draws(_draws(batch, replica)):  # a layer may draw noise in inference too
                y_pred = _forward(model, batch.x, training=False)
            with _weigh_losses_by_real_rows(model, batch, replica):
                _compute_loss(model, batch, y_pred, training=False)
        with torch.no_grad():
            _update_metrics(model, batch, y_pred)


def predict_step(model: keras.Model, batch: Batch, replica: Replica | None = None) -> Any:
    """This replica's predictions, as numpy, padding rows included (dropped by the gatherer). With
    ``replica``, a layer drawing noise in inference draws the global batch's (``_draws``)."""
    with torch.no_grad(), global_batch_draws(_draws(batch, replica)):
        y_pred = _forward(model, batch.x, training=False)
    return keras.tree.map_structure(keras.ops.convert_to_numpy, y_pred)
