"""Keras's ``steps_per_execution``: an epoch's steps run in groups, the batch hooks once a group.

What ``model.fit``/``evaluate``/``predict`` do with ``compile(steps_per_execution=N)``, on every
backend (Keras's ``EpochIterator``), measured on Keras 3.10, 3.15 and 3.16:

- the steps of an epoch run in groups of N from the epoch's first step; a group is N batches, or
  what the data has left (the last group may be shorter);
- ``on_*_batch_begin`` is called once before a group with its first step, ``on_*_batch_end`` once
  after it with ``first + N - 1`` (Keras 3.10: ``first``), even for a shorter last group, and the
  logs of its last step
  (``predict``: ``{"outputs": ...}`` of the whole group, concatenated);
- ``fit(steps_per_epoch=S)`` reads whole groups: an epoch is ``ceil(S / N) * N`` steps, as far as
  the data goes (the progress bar's target stays S); ``evaluate``/``predict(steps=S)`` the same;
- ``stop_training``/``stop_evaluating``/``stop_predicting`` are read after a group.

A trainer keeps that, and takes a checkpoint or answers a preemption notice at a group's end only,
so that a resumed epoch starts on a group's first step and calls the hooks where Keras would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, overload

import keras
import numpy as np


def _keras_at_least(major: int, minor: int) -> bool:
    found = tuple(int(part) for part in keras.version().split(".")[:2])
    return found >= (major, minor)


END_HOOK_GETS_GROUP_END = _keras_at_least(3, 11)  # Keras 3.10's loops give the group's first step


@dataclass(frozen=True)
class Executions:
    """Steps in groups of ``size`` (``model.steps_per_execution``), counted from an epoch's step 0.

    Groups of 4 over 10 steps begin at 0, 4, 8 and end at 3, 7, 9 (the last group two steps)::

        >>> executions = Executions(4)
        >>> [step for step in range(10) if executions.first(step)]
        [0, 4, 8]
        >>> [step for step in range(10) if executions.last(step, steps=10)]
        [3, 7, 9]
        >>> executions.rounded(5), executions.rounded(None)
        (8, None)
    """

    size: int = 1

    @classmethod
    def of(cls, model: keras.Model) -> Executions:
        """The model's ``steps_per_execution``, checked."""
        size = getattr(model, "steps_per_execution", 1)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"Model '{model.name}' was compiled with steps_per_execution={size!r}; a trainer needs a positive "
                "int, the number of steps between callbacks' batch hooks. Recompile with steps_per_execution=N."
            )
        return cls(size)

    def first(self, step: int) -> bool:
        """Whether ``step`` (of the epoch, from 0) begins a group: the batch-begin hooks run before it."""
        return step % self.size == 0

    def last(self, step: int, steps: int | None) -> bool:
        """Whether ``step`` ends a group, of an epoch of ``steps`` (None: not known; the caller also
        ends a group where the data ends): the batch-end hooks, checkpoints and stops come after it."""
        return (step + 1) % self.size == 0 or (steps is not None and step + 1 >= steps)

    def hook_step(self, step: int) -> int:
        """The step the batch-end hooks are given for the group holding ``step``: the group's first
        step plus ``size - 1``, whether or not the group is whole (Keras 3.11 on); Keras 3.10 gives
        them the group's first step, as its begin hooks."""
        first = step - step % self.size
        return first + self.size - 1 if END_HOOK_GETS_GROUP_END else first

    def group_start(self, step: int) -> int:
        """The first step of the group holding ``step``."""
        return step - step % self.size

    @overload
    def rounded(self, steps: int) -> int: ...
    @overload
    def rounded(self, steps: None) -> None: ...
    def rounded(self, steps: int | None) -> int | None:
        """The steps an epoch (or an evaluation) of ``steps`` reads: whole groups (None stays None)."""
        return None if steps is None else -(-steps // self.size) * self.size

    def checkpoint_due(self, due: Any, done: int, steps: int | None) -> bool:
        """Whether a checkpoint is due at the end of the group that ends with ``done`` steps done:
        ``due(steps_done, steps)`` (``CheckpointWriter.due``) held after any step of the group. None at
        the epoch's end: the epoch's own checkpoint follows there."""
        if steps is not None and done >= steps:
            return False
        return any(due(steps_done, steps) for steps_done in range(self.group_start(done - 1) + 1, done + 1))


ONE_STEP = Executions(1)


def concatenated(outputs: list[Any]) -> Any:
    """A group's predictions as one batch (``on_predict_batch_end``'s ``outputs``): each leaf of the
    steps' outputs joined on the row axis."""
    if len(outputs) == 1:
        return outputs[0]
    return keras.tree.map_structure(lambda *leaves: np.concatenate(leaves, axis=0), *outputs)
