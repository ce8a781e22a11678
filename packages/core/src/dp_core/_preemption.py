"""Preemption: a scheduler's notice ends a run at a step boundary, with a checkpoint, and loudly.

Schedulers and ``timeout`` send SIGTERM before they kill a job; SLURM sends SIGUSR1 (or what
``--signal`` names) ahead of its time limit. During ``fit``, either one only *asks*: every
replica stops at the same step boundary, rank 0 writes a checkpoint when ``checkpoint_dir`` is
set, and ``fit`` raises ``Preempted``, so a script exits non-zero and a rerun resumes exactly.
A second notice while stopping is not caught again: the signal's previous handling applies.
A notice that came when no step was left (``fit`` ended anyway) or that another error
overtook is not swallowed: it is sent again, to the previous handling, when ``fit`` returns.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(RuntimeError):  # noqa: N818 (the name users catch reads as what happened)
    """``fit`` stopped at epoch ``epoch``, step ``step`` (both from 0; ``step`` steps of that epoch
    were applied) on ``signal_name``; ``checkpoint`` is the path written then, or None."""

    def __init__(self, *, signal_name: str, epoch: int, step: int, checkpoint: str | None) -> None:
        where = f"epoch {epoch}, step {step} (both counted from 0)"
        if checkpoint is None:
            then = (
                "No checkpoint_dir was given, so nothing was saved: pass checkpoint_dir=... to fit to resume after a "
                "preemption."
            )
        else:
            then = f"A checkpoint of that step is at {checkpoint}; run the same fit again to resume from it."
        super().__init__(f"Training was preempted ({signal_name}) and stopped at {where}. {then}")
        self.signal_name, self.epoch, self.step, self.checkpoint = signal_name, epoch, step, checkpoint


class PreemptionWatch:
    """Within the block, SIGTERM and SIGUSR1 set ``requested`` (the signal's name) instead of
    ending the process; the previous handlers come back after it, and for a second notice. A
    notice the block did not end with ``Preempted`` is sent again as it leaves.

    Signal handlers can only be set from the main thread; elsewhere the watch sees nothing
    (``watching`` is False) and the signals keep their usual effect.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS) -> None:
        self.signals = signals
        self.requested: str | None = None
        self.watching = False
        self._previous: dict[signal.Signals, Any] = {}

    def _notice(self, signum: int, frame: FrameType | None) -> None:
        self.requested = signal.Signals(signum).name
        for number, previous in self._previous.items():  # a second notice is not caught again
            signal.signal(number, previous)

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, self._notice) for number in self.signals}
            self.watching = True
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous, self.watching = {}, False
        if self.requested is not None and not isinstance(error, Preempted):
            signal.raise_signal(signal.Signals[self.requested])
