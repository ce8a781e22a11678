"""Gradient accumulation with one gradient all-reduce per window, not per step.

A model compiled with ``gradient_accumulation_steps=k`` on its optimizer updates its weights
every k steps with the mean of those steps' gradients (Keras's ``optimizer.apply`` sums them
in its accumulators and applies ``(gradient + sum) / k`` on every k-th call). Here each replica
hands its own share of every step's gradient to ``apply``, so Keras's accumulators hold the
replica's partial sums and nothing travels; the k-th step of a window sends one all-reduce of
``accumulator + this step's share`` per variable, the accumulators are zeroed, and ``apply``
gets the summed window: Keras computes ``(summed + 0) / k``, the single-device update up to
float summation order, and counts ``optimizer.iterations`` and zeroes its accumulators as it
would on one device. Windows run across epoch boundaries, as in Keras.

What happens inside a window (all replicas agree on it, so none waits for another):

- A non-finite loss is noted on the device at the step and acted on at the next sync point:
  the window's last step, a checkpoint, a preemption notice or the end of ``fit``. With
  ``on_nonfinite_loss="stop"`` the fit stops there; with ``"skip"`` every replica leaves out the
  window's steps up to there: weights and optimizer slots were not touched yet, and the
  accumulators, ``iterations``, BatchNorm statistics, moving averages (``use_ema``) and this
  epoch's metric states go back to where the window began, so the next k steps make a whole
  window. Without checkpoints this is the whole window; a checkpoint in between splits it there.
- A preemption notice travels with the next all-reduce a step makes: the window's last step,
  or every step when callbacks act at every batch. A checkpoint is written there (mid-window
  is fine: see below) and every replica stops.
- Callbacks that act at every batch (``EarlyStopping`` on a batch metric, ``TerminateOnNaN``...)
  need each step's logs: every step then sums the metric states and rank 0's decisions (stop,
  learning rate) in a small all-reduce, the gradients still only at the window's end. A stop
  leaves the window's steps so far in the accumulators, as ``model.fit`` does.
- Checkpoints and the end of ``fit`` are sync points: the accumulators are summed over
  replicas onto rank 0 (the others hold zeros), which is what one device would hold. A
  checkpoint therefore saves that state, and a resumed fit (rank 0 restores it; the others
  zero theirs) gives the same next update as the uninterrupted run.

Steps keep their per-step collectives that are not gradients: the synchronized BatchNorm
moments (``batch_norm="global"``) and, for losses normalized by sample weights or masks, their
global sums. A model's own ``train_step`` (``_step.custom``) and these optimizers keep summing
gradients at every step, with the same updates as ``model.fit``: a ``LossScaleOptimizer``
(``mixed_float16``; its loss scale is decided on every step's global gradient) and variables
with ``overwrite_with_gradient`` (float8 training).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import keras
import torch

from dp_core import NO_STEP_TIMER, NonFiniteLoss, NoStepTimer, StepTimer
from dp_core.keras import internals, nonfinite_loss_stopped, skipped_message
from torch_dp._comm.collectives import all_reduce_sum
from torch_dp._comm.replica import Replica
from torch_dp._data.batches import Batch
from torch_dp._step.reduction import (
    ReductionLayout,
    all_reduce_after,
    decisions_on_device,
    flag,
    learning_rate_variable,
)
from torch_dp._step.steps import Trained, act_on_agreed, backward, forward_loss
from torch_dp._step.undo import NOTHING, StepUndo

Saved = list[tuple[keras.Variable, torch.Tensor]]


def _saved(variables: list[keras.Variable]) -> Saved:
    return [(v, v.value.detach().clone()) for v in variables]


def _put_back(saved: Saved) -> None:
    for variable, value in saved:
        variable.assign(value)


def accumulation_window(model: keras.Model, replica: Replica, on_nonfinite_loss: NonFiniteLoss) -> Window | None:
    """The window of a fit whose optimizer accumulates gradients over replicas (None: every
    step sums its gradients, as without accumulation). Called on every replica once rank 0's
    state is everywhere: rank 0 keeps the accumulators (the sums, as one device holds them),
    the others start from zero. One replica gets a window too, so that a non-finite loss is
    handled the same on any replica count."""
    optimizer = model.optimizer
    steps = getattr(optimizer, "gradient_accumulation_steps", None) or 0
    if steps < 2 or not model.trainable_weights:
        return None
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return None  # the loss scale reacts to every step's global gradient
    if any(getattr(v, "overwrite_with_gradient", False) for v in model.trainable_weights):
        return None  # such variables take each step's global gradient (a maximum), not a sum
    if not optimizer.built:
        optimizer.build(model.trainable_weights)
    if not replica.is_primary:
        for accumulator in internals.gradient_accumulators(optimizer):
            accumulator.assign(torch.zeros_like(accumulator.value))
    applied = int(internals.apply_count(optimizer).value.item())
    return Window(steps, applied, on_nonfinite_loss, torch.zeros(1, dtype=torch.float32, device=replica.device))


@dataclass
class _Start:
    """What a window's steps change, as it was when the window began (``skip`` puts it back)."""

    applied: int
    model_state: Saved  # BatchNorm statistics, seed generators
    optimizer_state: Saved  # accumulators (when not zero) and moving averages
    zero_accumulators: bool


@dataclass
class Window:
    """One fit's accumulation: k (``steps``), ``apply`` calls so far (a host copy of the optimizer's
    count, so no step waits for the device to learn where it is), and the open window."""

    steps: int
    applied: int
    on_nonfinite_loss: NonFiniteLoss
    nonfinite: torch.Tensor  # this replica's non-finite losses since the window began, on the device
    start: _Start | None = None
    metrics_start: Saved | None = None  # this epoch's metric states when the window began (or the epoch)
    metrics_epoch: int = -1
    place: tuple[int, int] = (0, 0)  # the last step taken (epoch, step)
    first_window: bool = True

    def train_step(
        self,
        model: keras.Model,
        batch: Batch,
        replica: Replica,
        *,
        epoch: int,
        step: int,
        sum_metrics: bool = False,
        stop: bool = False,
        changed: bool = False,
        preempt: bool = False,
        timer: StepTimer | NoStepTimer = NO_STEP_TIMER,
        decide: bool = True,
    ) -> Trained:
        """``_step.steps.train_step`` for step ``step`` of ``epoch`` inside a window: its gradient share
        accumulates locally, and the window's sum is all-reduced and applied on its last step.
        ``applied`` is False on a stop, a preemption, or a last step whose window had a
        non-finite loss (left out on every replica)."""
        self._begin(model, epoch, step)
        last = (self.applied + 1) % self.steps == 0
        exchange = last or sum_metrics  # something must travel: the gradients, or every batch's logs
        before = StepUndo.of(model) if exchange else NOTHING
        loss = forward_loss(model, batch, replica)
        trainable, local = backward(model, loss, replica)
        timer.lap("forward_backward", sync=True)
        nonfinite = (~torch.isfinite(torch.as_tensor(loss).detach().reshape(1))).to(torch.float32)
        if not exchange:
            self._accumulate(model, local, trainable, nonfinite)
            return Trained(True)
        decided = sum_metrics and decide  # as ``train_step``'s
        layout = ReductionLayout.of(model, logs=sum_metrics, counts_nonfinite=True, decisions=decided)
        rate = learning_rate_variable(model)
        decisions = decisions_on_device(rate, replica, stop=stop, changed=changed) if decided else None
        extras = layout.pack(self.nonfinite + nonfinite, flag(preempt, replica), model, decisions)
        shares = self._window_sums(model, local, trainable) if last else []  # this replica's share of the window's
        window_sums, summed = all_reduce_after(shares, extras, replica)
        agreed = layout.read(summed)
        timer.lap("all_reduce")
        ended = act_on_agreed(model, before, replica, rate, agreed)
        if ended is not None:
            return ended
        metric_sums = layout.metric_sums(summed) if sum_metrics else None
        if not last:
            self._accumulate(model, local, trainable, nonfinite)
            return Trained(True, metric_sums=metric_sums)
        if agreed.nonfinite:
            self._leave_out(model)
            return Trained(False)
        self._apply(model, local, trainable, window_sums=window_sums)
        timer.lap("optimizer", sync=True)
        return Trained(True, metric_sums=metric_sums)

    def settle(self, model: keras.Model, replica: Replica) -> None:
        """A sync point inside a window (a checkpoint, a preemption, the end of ``fit``): the
        accumulators summed onto rank 0, zeros elsewhere (one device's state, whatever reads it),
        and a non-finite loss in the window so far acted on, as ``on_nonfinite_loss`` says."""
        if self.applied % self.steps == 0:
            return  # no window open: every accumulator is zero
        optimizer = model.optimizer
        accumulators = internals.gradient_accumulators(optimizer)
        summed = all_reduce_sum([*(a.value.detach() for a in accumulators), self.nonfinite], replica)
        if summed[-1].item():
            self._leave_out(model)
            epoch, step = self.place
            if self.on_nonfinite_loss == "stop":
                raise nonfinite_loss_stopped(epoch, step, "torch_dp")
            if replica.is_primary:
                warnings.warn(skipped_message(epoch, step), RuntimeWarning, stacklevel=2)
            return
        with torch.no_grad():
            for accumulator, value in zip(accumulators, summed[:-1], strict=True):
                accumulator.assign(value if replica.is_primary else torch.zeros_like(value))

    def _begin(self, model: keras.Model, epoch: int, step: int) -> None:
        """Before a step: note what its window's steps change, when it opens one (or a new epoch
        began, for the metric states, which each epoch resets)."""
        self.place = (epoch, step)
        if self.start is None:
            optimizer = model.optimizer
            zero = self.applied % self.steps == 0 and not self.first_window  # Keras zeroed them at the last update
            kept = [] if zero else internals.gradient_accumulators(optimizer)
            self.start = _Start(
                self.applied,
                _saved(list(model.non_trainable_variables)),
                _saved([*kept, *internals.moving_averages(optimizer)]),
                zero,
            )
            self.first_window = False
            self.metrics_epoch = -1
        if epoch != self.metrics_epoch:
            self.metrics_start, self.metrics_epoch = _saved(list(model.metrics_variables)), epoch

    def _accumulate(
        self,
        model: keras.Model,
        local: list[torch.Tensor | None],
        trainable: list[keras.Variable],
        nonfinite: torch.Tensor,
    ) -> None:
        """Not a window's last step: Keras adds this replica's share to its accumulators (and
        moves its averages), nothing travels."""
        with torch.no_grad():
            model.optimizer.apply(local, trainable)
        self.applied += 1
        self.nonfinite += nonfinite

    def _window_sums(
        self, model: keras.Model, local: list[torch.Tensor | None], trainable: list[keras.Variable]
    ) -> list[torch.Tensor]:
        """This replica's share of the window's gradient sum, per variable: its accumulator plus
        this step's gradient, unscaled as ``apply`` unscales it (``loss_scale_factor``)."""
        optimizer = model.optimizer
        scale = optimizer.loss_scale_factor
        sums = []
        for variable, gradient in zip(trainable, local, strict=True):
            accumulated = internals.gradient_accumulator(optimizer, variable).value.detach()
            if gradient is None:
                sums.append(accumulated.clone())
            else:
                sums.append((gradient if scale is None else gradient / scale) + accumulated)
        return sums

    def _apply(
        self,
        model: keras.Model,
        local: list[torch.Tensor | None],
        trainable: list[keras.Variable],
        *,
        window_sums: list[torch.Tensor],
    ) -> None:
        """The window's update: accumulators zeroed, then ``apply`` on the summed window, which
        Keras divides by k, as on one device."""
        optimizer = model.optimizer
        with torch.no_grad(), _unscaled(optimizer):
            for accumulator in internals.gradient_accumulators(optimizer):
                accumulator.assign(torch.zeros_like(accumulator.value))
            optimizer.apply([None if g is None else s for g, s in zip(local, window_sums, strict=True)], trainable)
        self.applied += 1
        self.nonfinite.zero_()
        self.start = None

    def _leave_out(self, model: keras.Model) -> None:
        """Every replica: the window's steps so far leave nothing behind (``skip``; under
        ``stop`` the fit ends with the state from before the window)."""
        start = self.start
        assert start is not None  # a step of this window noted it
        model.zero_grad()
        _put_back(start.model_state)
        _put_back(start.optimizer_state)
        if self.metrics_start is not None:
            _put_back(self.metrics_start)
        optimizer = model.optimizer
        if start.zero_accumulators:
            for accumulator in internals.gradient_accumulators(optimizer):
                accumulator.assign(torch.zeros_like(accumulator.value))
        internals.apply_count(optimizer).assign(start.applied)
        self.applied = start.applied
        self.nonfinite.zero_()
        self.start = None


@contextlib.contextmanager
def _unscaled(optimizer: keras.optimizers.Optimizer) -> Iterator[None]:
    """``apply`` without dividing by ``loss_scale_factor``: the window's sums are unscaled already."""
    scale = optimizer.loss_scale_factor
    optimizer.loss_scale_factor = None
    try:
        yield
    finally:
        optimizer.loss_scale_factor = scale
