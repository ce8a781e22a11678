"""An epoch's current train state and the batch hooks called on it (``_loop.epochs``'s skeleton).

The hooks run at the ends of ``steps_per_execution`` groups only: the begin hook before a group's
first step, the end hook after its last, given the step Keras gives it (``Executions.hook_step``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, final

import keras

from jax_dp._step.state import ModelOnRequest, TrainState
from jax_dp._step.steps import Report, report_on_host


@dataclass(frozen=True)
class Pending:
    """A group's report that only the progress bar reads: read, and its batch-end hooks called (with
    ``step``, the group's hook step), once the next group is dispatched, so that the devices do not
    wait for the host's turn (the bar shows it a group later)."""

    report: Report | None
    step: int


@final
class HookedState:
    """An epoch's current state, and its batch hooks called on it. When a callback acts at every
    batch (``on_request``), the model holds ``state`` when a hook reads it, as in ``model.fit``,
    and what the hook changed (weights, learning rate) is read back into ``state`` (``ModelOnRequest``)."""

    def __init__(
        self,
        callbacks: keras.callbacks.CallbackList,
        state: TrainState,
        on_request: ModelOnRequest | None,
        *,
        stop_on_nonfinite: bool,
    ) -> None:
        self.callbacks, self.state, self.on_request = callbacks, state, on_request
        self.stop_on_nonfinite = stop_on_nonfinite
        self.pending: Pending | None = None  # the progress bar's report, not read yet

    def call(self, hook: Callable[..., None], *arguments: Any) -> None:
        if self.on_request is None:
            hook(*arguments)
        else:
            self.state = self.on_request.around(self.state, hook, *arguments)

    def report_stops(self, report: Report | None, step: int, *, hooks: bool) -> bool:
        """Reads ``report`` (waits for its group) and calls the batch-end hooks with ``step`` and its
        logs, before a checkpoint writes the state back over what a hook changed; whether a non-finite
        loss ends the loop there (``stop_on_nonfinite``)."""
        skipped, logs = (0, {}) if report is None else report_on_host(report)
        if skipped and self.stop_on_nonfinite:
            return True
        if hooks:
            self.call(self.callbacks.on_train_batch_end, step, logs)
        return False

    def pending_stops(self) -> bool:
        """``report_stops`` for the pending report, if any (then none is pending)."""
        pending, self.pending = self.pending, None
        return pending is not None and self.report_stops(pending.report, pending.step, hooks=True)

    def checkpointed(self) -> None:
        """A checkpoint wrote the state into the model."""
        if self.on_request is not None:
            self.on_request.written_back(self.state)
