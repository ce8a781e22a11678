"""Preemption: a scheduler's notice ends a run at a step boundary, with a checkpoint, and loudly.

Schedulers and ``timeout`` send SIGTERM before they kill a job; SLURM sends SIGUSR1 (or what
``--signal`` names) ahead of its time limit. During ``fit``, either one only *asks*: every
replica stops at the same step boundary, rank 0 writes a checkpoint when ``checkpoint_dir`` is
set, and ``fit`` raises ``Preempted``, so a script exits non-zero and a rerun resumes exactly.
A second notice while stopping is not caught again: the signal's previous handling applies.
A notice that came when no step was left (``fit`` ended anyway) is not swallowed: it is sent
again, to the previous handling, when ``fit`` returns.

Ctrl-C (SIGINT, where Python's own handler would raise ``KeyboardInterrupt``) is a notice too: the
first stops every replica at the next step boundary with a checkpoint, and the Trainer's call raises
``KeyboardInterrupt`` saying where that checkpoint is and how to resume (``interrupted``); a second
Ctrl-C meets Python's handler again and stops at once. When another error overtook it, the notice
is sent again only to a handler of the program's own; a default handling would end the process
before that error is printed, so the error carries a note of the notice instead.

Under torchrun a notice comes once: torchrun starts each worker in a session of its own, so a
terminal's Ctrl-C reaches torchrun alone, which passes it on to every worker.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import warnings
from types import FrameType, TracebackType
from typing import Any

from dp_core._checkpoint_format import CHECKPOINT_NAME, Checkpoint

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
    notice the block did not end with ``Preempted`` is sent again as it leaves (or, when another
    error leaves the block and the signal's handling is the default one, noted on that error).

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
            # Ctrl-C too, unless the program handles it its own way (a worker ignoring it, a handler of its own)
            interrupt = (signal.SIGINT,) if signal.getsignal(signal.SIGINT) is signal.default_int_handler else ()
            self._previous = {number: signal.signal(number, self._notice) for number in (*self.signals, *interrupt)}
            self.watching = True
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        previous_handlers, self._previous, self.watching = self._previous, {}, False
        for number, previous in previous_handlers.items():
            signal.signal(number, previous)
        if self.requested is None or isinstance(error, Preempted):
            return
        notice = signal.Signals[self.requested]
        if error is not None and not callable(previous_handlers.get(notice)):
            note = (
                f"{notice.name} arrived during this run and was not acted on: this error ended the run first. "
                "The process was left running so that this error is seen."
            )
            if sys.version_info >= (3, 11):
                error.add_note(note)
            else:  # no exception notes before 3.11
                warnings.warn(note, RuntimeWarning, stacklevel=2)
            return
        signal.raise_signal(notice)


def interrupted(error: BaseException, call: str) -> KeyboardInterrupt:
    """What a Trainer's ``call`` raises for Ctrl-C, in one short paragraph and without the replicas'
    tracebacks: ``error`` is the fit's ``Preempted`` by SIGINT (every replica stopped at a step
    boundary) or a ``KeyboardInterrupt`` (a second Ctrl-C, or one outside a fit's steps: at once).

    >>> stopped = Preempted(signal_name="SIGINT", epoch=2, step=5, checkpoint="ckpt/step-000002-000000005")
    >>> message = str(interrupted(stopped, "fit"))
    >>> message.startswith("Ctrl-C: training stopped at epoch 2, step 5"), "checkpoint_dir='ckpt'" in message
    (True, True)
    """
    if not isinstance(error, Preempted):
        if call != "fit":
            return KeyboardInterrupt(f"Ctrl-C: {call} stopped at once.")
        return KeyboardInterrupt(
            "Ctrl-C again: training stopped at once, mid-step, with no checkpoint of where it stopped. The last "
            "checkpoint in checkpoint_dir, if one was given, still resumes: run the same fit again."
        )
    where = f"Ctrl-C: training stopped at epoch {error.epoch}, step {error.step} (both counted from 0) on every replica"
    if error.checkpoint is None:
        then = "Nothing was saved: pass checkpoint_dir=... to fit to resume after a Ctrl-C."
    else:
        directory, path = _checkpoint_written(error, error.checkpoint)
        then = (
            f"A checkpoint of it is at {path}: run the same fit again with checkpoint_dir={directory!r} "
            f"to resume from it (trainer.fit(model, ..., checkpoint_dir={directory!r}))."
        )
    return KeyboardInterrupt(f"{where}; the model holds the weights of that step. {then}")


def _checkpoint_written(stop: Preempted, checkpoint: str) -> tuple[str, str]:
    """The checkpoint directory and the stop's checkpoint in it, named by the stop's epoch and step:
    ``Preempted`` names the newest listed when the stop was taken, which a write in the background may
    not have reached, and on a process that does not write (a replica other than rank 0, jax's
    process 1 and up) only the directory."""
    directory = (
        checkpoint if CHECKPOINT_NAME.match(os.path.basename(checkpoint)) is None else os.path.dirname(checkpoint)
    )
    return directory, os.path.join(directory, Checkpoint(stop.epoch, stop.step, 0, 0, 0, []).name)
