"""A preemption notice during ``fit``: every process stops at the same step (``dp_core.Preempted``).

One process: SIGTERM and SIGUSR1 are watched by ``dp_core.PreemptionWatch`` and acted on at
the next step. Several processes: jax's own preemption service already catches SIGTERM and
tells every process; ``multihost_utils.reached_preemption_sync_point`` then names one step on
all of them, which is where they stop. SIGUSR1 (what SLURM sends ahead of its time limit) is
handed to that service as a SIGTERM, and so is the first Ctrl-C (SIGINT, where Python's own handler
would raise ``KeyboardInterrupt``): to every process of the job as a terminal sends it, or to one
alone, every process stops at the next step boundary; a second Ctrl-C meets Python's handler again
and stops at once. Where they stop, the processes agree on the notice's name (a Ctrl-C on any of
them makes it ``SIGINT`` on all), so each says the same thing.

jax's preemption service answers one notice in a process's lifetime (``_service_spent``): after a
stop, a later fit of the same processes leaves Ctrl-C and SIGUSR1 their usual effect.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from dp_core import Preempted, PreemptionWatch, list_checkpoints
from jax_dp._internals import preemption_service_running

# Every process calls the sync point at every step of every fit, in the same order, with
# ids that only grow (jax's protocol): one counter for the process's lifetime.
_sync_ids = itertools.count()
_active: PreemptionNotice | None = None  # the fit running now
_service_spent = False  # jax's service was handed a notice in this process: it takes no other
# What a process's own notice was, in the order one wins over another where the processes agree on one.
_NOTICES = ("SIGTERM", "SIGUSR1", "SIGINT")


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
        self._service = self.processes > 1 and preemption_service_running() and not _service_spent
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> PreemptionNotice:
        global _active
        _active = self
        if self._watch is not None:
            self._watch.__enter__()
        elif self._service and threading.current_thread() is threading.main_thread():
            # Ctrl-C too, unless the program handles it its own way (a handler of its own)
            interrupt = (signal.SIGINT,) if signal.getsignal(signal.SIGINT) is signal.default_int_handler else ()
            notices = (signal.SIGUSR1, *interrupt)
            self._previous = {number: signal.signal(number, self._to_service) for number in notices}
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        global _active
        _active = None
        if self._watch is not None:
            self._watch.__exit__(kind, error, trace)
        self._restore()

    def _restore(self) -> None:
        previous, self._previous = self._previous, {}
        for number, handler in previous.items():
            signal.signal(number, handler)

    def _to_service(self, signum: int, frame: FrameType | None) -> None:
        """A notice handed to jax's preemption service, which tells every process; a second one, of
        either kind, meets the signal's previous handling (Ctrl-C: ``KeyboardInterrupt`` at once)."""
        global _service_spent
        self.signal_name, _service_spent = signal.Signals(signum).name, True
        self._restore()
        os.kill(os.getpid(), signal.SIGTERM)

    def stop_now(self) -> bool:
        """Whether every process stops before the next step (the same answer on each, at the same step)."""
        if self._watch is not None:
            self.signal_name = self._watch.requested
            return self.signal_name is not None
        if not self._service:
            return False
        if multihost_utils.reached_preemption_sync_point(next(_sync_ids)):
            global _service_spent
            _service_spent = True
            self.signal_name = _agreed_notice(self.signal_name)
            return True
        return False


def _agreed_notice(own: str | None) -> str:
    """The notice every process names at a stop: the strongest of their own (a process that was
    only told by jax's service has none; then it was a SIGTERM). A collective: every process."""
    own_rank = np.asarray(_NOTICES.index(own or "SIGTERM"), np.int32)
    return _NOTICES[int(np.max(multihost_utils.process_allgather(own_rank)))]
