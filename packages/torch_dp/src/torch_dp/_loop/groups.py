"""Keras's ``steps_per_execution`` in torch-dp's loops: an epoch's steps run in groups of N
(``dp_core.keras.Executions`` says which), and everything that needs the host or rank 0's callbacks
happens at a group's boundaries only.

Within a group the steps run back to back on every replica: no batch hook, no logs read, no
decision of rank 0 shared, no checkpoint, no preemption notice answered. At its boundaries:

- before its first step, ``on_*_batch_begin(first step)``; rank 0's decisions since the last group's
  end (its end hook's stop, learning rate, changed state, and this begin hook's) reach every replica
  there: broadcast before the step, or on the first step's all-reduce when they travel with the step;
- a preemption notice travels with the first step too, so every replica stops on a group boundary;
- after its last step, the logs (summed on its all-reduce when a callback acts at every batch, or
  read when ``Trainer(log_every_steps=...)`` falls in the group), ``on_*_batch_end(first + N - 1,
  logs)``, a checkpoint when one of its steps was due, and ``stop_evaluating``/``stop_predicting``.

A group the data ends in (a source that does not say its length) is closed after the data ends,
as Keras closes it. With N = 1 every step is a group of its own: the loops are as before.
"""

from __future__ import annotations

from typing import NamedTuple

from dp_core.keras import Executions
from torch_dp._step.metrics import logs_due


class InGroup(NamedTuple):
    """Where a step lies in its group."""

    first: bool  # the group's first step: its begin hook, rank 0's decisions, preemption notices
    last: bool  # the group's last step, as far as known (a source of unknown length may end a group early)


ALONE = InGroup(first=True, last=True)  # a group of one step (``steps_per_execution=1``)


def in_group(executions: Executions, step: int, steps: int | None, *, first_step: int = 0) -> InGroup:
    """Where ``step`` of an epoch of ``steps`` lies; ``first_step``, where a resumed epoch starts,
    begins a group (a checkpoint lies on a group boundary, unless it was written with another N).

    >>> [in_group(Executions(4), step, 10) for step in (0, 5, 9)]
    [InGroup(first=True, last=False), InGroup(first=False, last=False), InGroup(first=False, last=True)]
    """
    return InGroup(executions.first(step) or step == first_step, executions.last(step, steps))


def logs_due_at(step: int, steps: int | None, every: int, *, first_step: int = 0) -> bool:
    """Whether the logs are read (summed over replicas) after ``step``: the progress bar shows the
    metrics from the epoch's first step (``first_step``, where a resumed epoch starts), as in
    ``model.fit``, then new values every ``every`` steps (``Trainer(log_every_steps=...)``) and at
    the last; never with ``every=0`` (nothing shows them). One small all-reduce each.

    >>> [step for step in range(25) if logs_due_at(step, 25, 10)]
    [0, 9, 19, 24]
    """
    return every > 0 and (step == first_step or logs_due(step, steps, every))


def group_logs_due(executions: Executions, step: int, steps: int | None, every: int, *, first_step: int = 0) -> bool:
    """At the end of the group whose last step is ``step``: whether the logs are read, because
    ``logs_due_at`` holds for one of the group's steps (they are read once, after its last).

    >>> [step for step in (3, 7, 9) if group_logs_due(Executions(4), step, 10, 5)]
    [3, 7, 9]
    >>> [step for step in (3, 7, 11, 15) if group_logs_due(Executions(4), step, 16, 10)]
    [3, 11, 15]
    """
    start = max(executions.group_start(step), first_step)
    return any(logs_due_at(at, steps, every, first_step=first_step) for at in range(start, step + 1))
