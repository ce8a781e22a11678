"""A preemption notice during ``fit``: every process stops at the same step (``dp_core.Preempted``).

One process: SIGTERM and SIGUSR1 are watched by ``dp_core.PreemptionWatch`` and acted on at
the next step. Several processes: jax's own preemption service already catches SIGTERM and
tells every process; ``multihost_utils.reached_preemption_sync_point`` then names one step on
all of them, which is where they stop. SIGUSR1 (what SLURM sends ahead of its time limit) is
handed to that service as a SIGTERM.
"""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

import jax
from jax.experimental import multihost_utils

from dp_core import Preempted, PreemptionWatch, list_checkpoints
from jax_dp._internals import preemption_service_running

# Every process calls the sync point at every step of every fit, in the same order, with
# ids that only grow (jax's protocol): one counter for the process's lifetime.
_sync_ids = itertools.count()
_active: PreemptionNotice | None = None  # the fit running now


class StoppedAt(Exception):  # noqa: N818 (not an error: the step loop's way out)
    """Out of a step loop: every process stops after ``done`` steps of the epoch, in ``state``."""

    def __init__(self, done: int, state: Any) -> None:
        super().__init__(done)
        self.done, self.state = done, state


def check(done: int, state: Any) -> None:
    """After a step: ``StoppedAt`` when the running fit was asked to stop (the same step on every process)."""
    if _active is not None and _active.stop_now():
        raise StoppedAt(done, state)


def preempted(
    stop: StoppedAt,
    *,
    epoch: int,
    write_back: Callable[[Any], object],
    checkpoint: Callable[[Any, int], None] | None,
    directory: str | None,
) -> Preempted:
    """The model given the state ``stop`` holds, a checkpoint of that step if ``checkpoint``, and the error to raise."""
    write_back(stop.state)
    path = None
    if checkpoint is not None and directory is not None:
        checkpoint(stop.state, stop.done)  # a collective: every process
        written = list_checkpoints(directory) if jax.process_index() == 0 else []
        path = str(written[-1]) if written else directory
    signal_name = (_active.signal_name if _active is not None else None) or "SIGTERM"
    return Preempted(signal_name=signal_name, epoch=epoch, step=stop.done, checkpoint=path)


class PreemptionNotice:
    """Within a ``fit``: ``stop_now()`` after each step says whether to stop before the next."""

    def __init__(self) -> None:
        self.processes = jax.process_count()
        self.signal_name: str | None = None
        self._watch = PreemptionWatch() if self.processes == 1 else None
        # Without jax's preemption service (jax_enable_preemption_service=False) no step can be
        # agreed on: notices then keep their usual effect.
        self._service = self.processes > 1 and preemption_service_running()
        self._previous_usr1: object = None

    def __enter__(self) -> PreemptionNotice:
        global _active
        _active = self
        if self._watch is not None:
            self._watch.__enter__()
        elif self._service:
            try:
                self._previous_usr1 = signal.signal(signal.SIGUSR1, self._as_sigterm)
            except ValueError:  # not the main thread: SIGUSR1 keeps its usual effect
                self._previous_usr1 = None
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        global _active
        _active = None
        if self._watch is not None:
            self._watch.__exit__(kind, error, trace)
        elif self._previous_usr1 is not None:
            signal.signal(signal.SIGUSR1, self._previous_usr1)  # type: ignore[arg-type]

    def _as_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.signal_name = "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)  # to jax's preemption service, which tells every process

    def stop_now(self) -> bool:
        """Whether every process stops before the next step (the same answer on each, at the same step)."""
        if self._watch is not None:
            self.signal_name = self._watch.requested
            return self.signal_name is not None
        if not self._service:
            return False
        if multihost_utils.reached_preemption_sync_point(next(_sync_ids)):
            self.signal_name = self.signal_name or "SIGTERM"
            return True
        return False
