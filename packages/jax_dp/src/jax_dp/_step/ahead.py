"""How an epoch's train steps run for the host: one at a time, or started ahead, so the next
step runs while the host reads the last one's logs (a ``Report``, ``_step.steps``).

A callback that acts at every batch needs each step's logs on the host before its hooks run,
and the next step must wait for those hooks, which may change the model or stop training.
Waiting leaves the devices idle while the host reads the logs, runs the hooks and dispatches
the next step, a turn that costs a short step much of its throughput. So the next step is
started from the state as it is before the hooks, by a step that keeps (does not donate) that
state, and used only if the hooks left that very state in place (``ModelOnRequest`` hands
back a new state when a hook changed the model); otherwise it is run again from the changed
state. The kept state is one more copy of the state on every device, so only a state up to
``AHEAD_MAX_STATE_BYTES`` is stepped ahead; a larger one makes steps long enough anyway.

On CPU, two programs with collectives in flight at once, neither waiting for the other, can
hold each other's rendezvous; so a step started ahead is waited for (``settle``) before
anything else runs on the mesh.
"""

from __future__ import annotations

from typing import Any, Protocol, final

import jax

from jax_dp._step.state import TrainState
from jax_dp._step.steps import Report, ReportingStep, Steps

AHEAD_MAX_STATE_BYTES = 256 * 2**20


class Stepper(Protocol):
    """How an epoch's loop runs its train steps: ``run`` the step on a batch (with its report
    when ``report``), ``start`` the next one early where it can, ``settle`` before anything else
    uses the mesh."""

    def run(self, state: TrainState, batch: Any, *, report: bool) -> tuple[TrainState, Report | None]: ...

    def start(self, state: TrainState, batch: Any) -> None: ...

    def settle(self) -> None: ...


def stepper(steps: Steps, state: TrainState, padded: bool, *, every_batch: bool) -> Stepper:
    """Steps started ahead when a callback reads every batch and the state is small enough to
    keep twice; otherwise one at a time."""
    if every_batch and small_enough_to_keep(state):
        return StepsAhead(steps.train_reporting, padded)
    return OneAtATime(steps, padded)


def small_enough_to_keep(state: TrainState) -> bool:
    """Whether one more copy of ``state`` on each device is within ``AHEAD_MAX_STATE_BYTES``."""
    leaves = jax.tree.leaves((state.trainable, state.non_trainable, state.optimizer))
    return sum(leaf.nbytes for leaf in leaves) <= AHEAD_MAX_STATE_BYTES


@final
class OneAtATime:
    """The donating train step; a report only when asked for, read before the next step starts."""

    def __init__(self, steps: Steps, padded: bool) -> None:
        self.steps = steps
        self.padded = padded

    def run(self, state: TrainState, batch: Any, *, report: bool) -> tuple[TrainState, Report | None]:
        state = self.steps.train(state, batch, self.padded)
        return state, self.steps.report(state.metrics, state.counts.skipped) if report else None

    def start(self, state: TrainState, batch: Any) -> None:
        pass

    def settle(self) -> None:
        pass


@final
class StepsAhead:
    """Each step started before the hooks after the previous step ran; always reports."""

    def __init__(self, step: ReportingStep, padded: bool) -> None:
        self.step = step
        self.padded = padded
        self._started: tuple[TrainState, tuple[TrainState, Report]] | None = None

    def run(self, state: TrainState, batch: Any, *, report: bool = True) -> tuple[TrainState, Report | None]:
        """The step on ``batch`` from ``state``: the one started ahead, if from this very state."""
        started, self._started = self._started, None
        if started is not None:
            source, result = started
            if source is state:
                return result
            jax.block_until_ready(result)  # dropped: the hooks changed the state
        return self.step(state, batch, self.padded)

    def start(self, state: TrainState, batch: Any) -> None:
        """Starts the step on ``batch`` from ``state`` now, before the hooks that may change ``state``."""
        self._started = (state, self.step(state, batch, self.padded))

    def settle(self) -> None:
        """Waits for a step started ahead (kept for ``run``), before other programs use the mesh."""
        if self._started is not None:
            jax.block_until_ready(self._started[1])
