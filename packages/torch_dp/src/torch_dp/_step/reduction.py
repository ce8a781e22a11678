"""What a training step sums over replicas besides its gradients, and where (``ReductionLayout``).

A step's all-reduce carries, after the gradients (with buckets, in the last one, ``_step.buckets``):
the control pair ``[the loss, or a window's non-finite losses; preemption notices]``, then, when
callbacks act at every batch, the metric states and rank 0's ``Decisions``. Keras's step
(``_step.steps``) and a gradient-accumulation window's (``_step.accumulation``) lay it out the same
way, and every replica reads the few values that decide a step on the host at once (``Agreed``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import keras
import torch

from dp_core.keras import internals
from torch_dp._comm.collectives import all_reduce_sum
from torch_dp._comm.replica import Replica


class Decisions(NamedTuple):
    """Rank 0's decisions since the last step, as a step carries them (float32, in this order;
    the other replicas send zeros, so the sums are rank 0's)."""

    stop: float  # 1.0: rank 0 stopped training (every replica undoes the step and leaves the epoch)
    learning_rate: float  # rank 0's, which every replica takes before applying (0.0: no variable rate)
    changed: float  # 1.0: rank 0's callbacks changed its state (every replica undoes the step, ``_loop.changes``)


_AT = Decisions(stop=0, learning_rate=1, changed=2)  # each decision's index in the tensor a step sends (as int)


def decisions_on_device(rate: keras.Variable | None, replica: Replica, *, stop: bool, changed: bool) -> torch.Tensor:
    """Rank 0's ``Decisions`` as a step sends them (zeros elsewhere), built on the device: reading
    the rate would wait for the device."""
    decisions = torch.zeros(len(_AT), dtype=torch.float32, device=replica.device)
    if not replica.is_primary:
        return decisions
    decisions[int(_AT.stop)] = float(stop)
    decisions[int(_AT.changed)] = float(changed)
    if rate is not None:
        decisions[int(_AT.learning_rate)] = rate.value.detach().reshape(())  # a copy on the device, rounded to float32
    return decisions


def learning_rate_variable(model: keras.Model) -> keras.Variable | None:
    """The optimizer's learning rate where it is a variable (a schedule's is computed, not sent)."""
    rate = internals.learning_rate_object(model.optimizer)
    return rate if isinstance(rate, keras.Variable) else None


def flag(value: bool, replica: Replica) -> torch.Tensor:
    # filled on the device: torch.tensor(..., device="cuda") would copy from the host and wait
    return torch.full((1,), float(value), dtype=torch.float32, device=replica.device)


class Agreed(NamedTuple):
    """What every replica reads of a step's sums, in one device-to-host read (one wait for the
    device per step, not one per value): what decides whether its update is applied."""

    nonfinite: bool  # some replica's loss was not finite (a window's: in one of its steps so far)
    preempted: bool  # some replica got a preemption notice: every replica stops at this step
    decisions: Decisions | None  # rank 0's, when they travelled


@dataclass(frozen=True)
class ReductionLayout:
    """Where one kind of step puts what it sums besides its gradients, in this order: the control
    pair, ``metric_states`` metric variables, then rank 0's ``Decisions`` when ``decisions``."""

    metric_states: int  # the metric variables summed (0: the logs do not travel)
    decisions: bool  # rank 0's decisions close the buffer
    counts_nonfinite: bool = False  # the control's first value counts non-finite losses, else it is the loss

    @classmethod
    def of(
        cls, model: keras.Model, *, logs: bool, counts_nonfinite: bool = False, decisions: bool | None = None
    ) -> ReductionLayout:
        """``logs``: the metric states and rank 0's decisions travel (callbacks act at every batch);
        ``decisions=False``: the states only (a step inside a group of ``steps_per_execution``)."""
        return cls(
            len(model.metrics_variables) if logs else 0, logs if decisions is None else decisions, counts_nonfinite
        )

    def pack(
        self, first: torch.Tensor, preempted: torch.Tensor, model: keras.Model, decisions: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """The values to sum: ``first`` (one float: the loss, or the non-finite losses counted) and
        this replica's preemption ``flag``, then the model's metric states and ``decisions`` as laid out."""
        assert (decisions is not None) == self.decisions
        states = [v.value.detach() for v in model.metrics_variables] if self.metric_states else []
        assert len(states) == self.metric_states
        return [torch.cat([first, preempted]), *states, *([] if decisions is None else [decisions])]

    def metric_sums(self, summed: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The metric states summed over every replica, from what ``pack`` gave, summed."""
        return list(summed[1 : 1 + self.metric_states])

    def read(self, summed: Sequence[torch.Tensor]) -> Agreed:
        """The control pair and the decisions, summed, read on the host at once (one small copy; the
        rest in Python: a step's host time on a small model is mostly such calls)."""
        values = torch.cat([summed[0], summed[1 + self.metric_states]]) if self.decisions else summed[0]
        first, anyone_preempted, *decided = values.tolist()
        nonfinite = first > 0 if self.counts_nonfinite else not math.isfinite(first)
        decisions = Decisions(*decided) if self.decisions else None
        return Agreed(nonfinite, bool(anyone_preempted), decisions)


def all_reduce_after(
    gradients: Sequence[torch.Tensor], extras: Sequence[torch.Tensor], replica: Replica
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``gradients`` and a step's ``extras`` (``ReductionLayout.pack``'s, after them) summed in one
    all-reduce: the gradients' sums and the extras'."""
    summed = all_reduce_sum([*gradients, *extras], replica)
    return summed[: len(gradients)], summed[len(gradients) :]
